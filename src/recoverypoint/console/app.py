"""The console as one ASGI app: its routes, and what it is built from."""

from __future__ import annotations

import functools
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..admin import Admin
from ..engine import Engine
from . import actions, pages
from .auth import Authorize, checked
from .render import problem
from .site import Page, Site

STYLESHEET = "/static/console.css"
"""The console's one static asset: the same for everyone, no data in it, so it is served
before the token (the login page needs it too)."""


def console(engine: Engine | Admin, *, authorize: Authorize) -> Starlette:
    """The web console of ``engine``'s keys and staged jobs, to mount in your app::

        app.mount("/recoverypoint", console(engine, authorize=authorize))

    ``authorize(request, action)`` is asked on every request (see :mod:`.auth`): it
    returns who the visitor is, or ``None`` to refuse. It is required: there is no
    console without one. Pass an :class:`~recoverypoint.admin.Admin` instead of an
    engine to choose its ``stuck_after`` or retention.

    Refuse other ``Host`` names than yours in front of it (a proxy routing by name, or
    ``app.add_middleware(OwnHosts, hosts=["ops.example.com"])``, :class:`.hosts.OwnHosts`):
    its CSRF check compares ``Origin`` with the ``Host`` a request names, which a
    DNS-rebinding page chooses.
    """
    operator = engine if isinstance(engine, Admin) else Admin.for_engine(engine)
    site = Site(operator, checked(authorize))

    def route(path: str, handler: Page, method: str = "GET") -> Route:
        return Route(path, functools.partial(handler, site), methods=[method])

    routes = [
        route("/", pages.overview),
        route("/keys", pages.keys),
        route("/keys/bulk/{action}", actions.confirm_bulk),
        route("/keys/bulk/{action}", actions.act_bulk, "POST"),
        route("/keys/{key_id:int}", pages.key),
        route("/keys/{key_id:int}/{action}", actions.confirm_one),
        route("/keys/{key_id:int}/{action}", actions.act_one, "POST"),
        route("/jobs", pages.jobs),
        route("/audit", pages.audit),
        route("/audit/{entry_id:int}", pages.audit_entry),
        route("/reveal", pages.reveal, "POST"),
        Route(STYLESHEET, pages.stylesheet),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


async def _http_error(request: Request, exc: Any) -> Response:
    """No route, or not this method: the console's own page, not a framework's."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    title = {404: "Not found", 405: "Not allowed"}.get(status, "Bad request")
    return problem(request, status, title, "There is no such page in the console.")
