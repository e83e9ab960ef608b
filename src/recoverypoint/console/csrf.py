"""Cross-site request forgery: every form that changes something carries a token.

Double submit, with two more locks: the token is a random value in a cookie of its own
(``HttpOnly``, ``SameSite=Strict``, for the console's path only) and in a hidden field;
a POST must carry both, equal, and come from the console's own origin (``Origin``, else
``Referer``, naming the host the request was sent to). Nothing is kept on the server, so
any number of processes can serve the same console.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

COOKIE = "rp_console_csrf"
FIELD = "csrf"


class CsrfFailed(Exception):
    """A POST without a valid token or from another origin: refused, nothing done."""


def cookie_path(request: Request) -> str:
    return str(request.scope.get("root_path", "")) or "/"


def token(request: Request) -> str:
    """The visitor's token, kept in ``request.state`` for the response to set."""
    current = request.cookies.get(COOKIE, "")
    if not _well_formed(current):
        current = getattr(request.state, "csrf_new", "") or secrets.token_urlsafe(32)
        request.state.csrf_new = current
    return current


def set_cookie(request: Request, response: Response) -> None:
    """Set the cookie when :func:`token` made a new one for this page's forms."""
    new = getattr(request.state, "csrf_new", "")
    if new:
        response.set_cookie(
            COOKIE,
            new,
            path=cookie_path(request),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )


def check(request: Request, submitted: str) -> None:
    """Refuse the POST unless its origin is ours and its token matches the cookie."""
    same_origin(request)
    cookie = request.cookies.get(COOKIE, "")
    # compare_digest takes ASCII str only: both are checked for that first.
    if not (
        _well_formed(cookie) and _well_formed(submitted) and hmac.compare_digest(cookie, submitted)
    ):
        raise CsrfFailed("the form's token does not match: reload the page and try again")


async def checked_form(request: Request) -> FormData:
    """The POSTed form, once its token and origin are checked."""
    fields = await request.form()
    sent = fields.getlist(FIELD)
    check(request, sent[0] if len(sent) == 1 and isinstance(sent[0], str) else "")
    return fields


def same_origin(request: Request) -> None:
    source = request.headers.get("origin") or request.headers.get("referer") or ""
    host = request.headers.get("host")
    try:
        sent_from = urlsplit(source).netloc
    except ValueError:  # not a URL (an unclosed IPv6 bracket): from nowhere of ours
        sent_from = ""
    # Host names are case-insensitive (RFC 9110): the standalone console lowers ``Host``
    # before it gets here, while a Referer keeps whatever case it was written in.
    if not sent_from or not host or sent_from.lower() != host.lower():
        raise CsrfFailed("this form was not sent from the console's own pages")


def _well_formed(value: str) -> bool:
    return 32 <= len(value) <= 64 and value.isascii()
