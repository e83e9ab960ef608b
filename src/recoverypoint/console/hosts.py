"""The standalone console's ``Host`` check, against DNS rebinding: a page of another site
whose name an attacker points at the console's address sends that name as its ``Host``,
and is refused before the console sees the request.

The check is the console's own rather than Starlette's ``TrustedHostMiddleware``: how that
one splits a ``Host`` from its port has changed between releases, and older ones let
``127.0.0.1:8080@evil`` through as ``127.0.0.1``. Here a ``Host`` is a name and at most a
port of digits, and anything else is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

# A name (compared whole with the console's own) and at most a port.
_HOST = re.compile(r"(?P<name>[^:\[\]]*|\[[^\]]*\])(?::[0-9]+)?")


class OwnHosts:
    """Refuses (400) a request whose ``Host`` names none of ``hosts`` (lower-case names
    or bracketed IPv6 addresses, a port aside), and hands ``app`` the ``Host`` in lower
    case: host names are case-insensitive (RFC 9110), and the CSRF check compares
    ``Origin`` with it."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # the server's lifespan events
            await self.app(scope, receive, send)
            return
        sent = [value for name, value in scope["headers"] if name == b"host"]
        host = sent[0].decode("latin-1").lower() if len(sent) == 1 else ""
        named = _HOST.fullmatch(host)
        if named is None or named["name"] not in self.hosts:
            refusal: ASGIApp
            if scope["type"] == "http":
                refusal = PlainTextResponse("Invalid host header", status_code=400)
            else:
                refusal = WebSocketClose()
            await refusal(scope, receive, send)
            return
        headers = [(n, v.lower() if n == b"host" else v) for n, v in scope["headers"]]
        await self.app({**scope, "headers": headers}, receive, send)
