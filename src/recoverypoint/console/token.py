"""The standalone console's lock: a token, asked once per browser.

``recoverypoint console`` prints a token at start (or takes ``--token``). A visitor
without it gets a page asking for it; once given, an ``HttpOnly``, ``SameSite=Strict``
cookie holds its hash until the browser closes. The authorizer checks that cookie on every
request too, so the console refuses a visitor even if the login page were bypassed.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from . import csrf, forms
from .app import STYLESHEET
from .auth import VIEW
from .render import page, secure

COOKIE = "rp_console_token"
HOLDER = "token holder"


class TokenLock:
    """``authorize`` for a console only the token opens, and the login page in front."""

    def __init__(self, token: str, *, read_only: bool = False) -> None:
        if len(token) < 16:
            raise ValueError("a console token must be 16 characters or more")
        self._digest = _digest(token)
        self.read_only = read_only

    def authorize(self, request: Request, action: str) -> str | None:
        if not self.opened(request):
            return None
        if self.read_only and action != VIEW:
            return None
        # Everyone holds the same token: where they came from tells them apart in the audit.
        return f"{HOLDER} at {request.client.host}" if request.client else HOLDER

    def opened(self, request: Request) -> bool:
        held = request.cookies.get(COOKIE, "")
        return held.isascii() and hmac.compare_digest(held, self._digest)

    def guard(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind the login page."""

        async def locked(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            request = Request(scope, receive)
            if (self.opened(request) and request.url.path != "/login") or _public(request):
                await app(scope, receive, send)
                return
            response = await self._login(request)
            await response(scope, receive, send)

        return locked

    async def _login(self, request: Request) -> Response:
        if request.method != "POST" or request.url.path != "/login":
            return page(request, "login.html", 401, error=None)
        try:
            csrf.same_origin(request)
            given = forms.text(await request.form(), "token") or ""
        except (csrf.CsrfFailed, forms.FormError):
            given = ""
        if not hmac.compare_digest(_digest(given), self._digest):
            return page(request, "login.html", 401, error="That is not the console's token.")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, self._digest, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")  # fmt: skip
        return secure(response)


def _public(request: Request) -> bool:
    """The stylesheet, to anyone: the login page is styled by it. That exact path, read
    only; nothing else passes without the token."""
    return request.method in ("GET", "HEAD") and request.scope["path"] == STYLESHEET


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
