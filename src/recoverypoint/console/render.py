"""Pages: the templates, the filters they use, and the headers every response carries.

Autoescaping is on everywhere; the only markup built in Python is the chart's SVG
(:mod:`.chart`), from numbers. The headers forbid framing (an action's button cannot be
clickjacked), inline scripts and styles, caching, and referrers (a listing's URL may hold
a filter on a key or a scope).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from . import csrf

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def seconds(value: float | None) -> str:
    """``75`` → ``1m 15s``; two units at most, as an operator reads an age."""
    if value is None:
        return "-"
    sign, left = ("-" if value < 0 else ""), int(abs(value))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return sign + " ".join(parts[:2])


def due(value: float | None) -> str:
    """Seconds until a next attempt (negative: overdue)."""
    if value is None:
        return "-"
    return f"overdue {seconds(-value)}" if value < 0 else f"in {seconds(value)}"


def moment(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


environment = Environment(
    loader=PackageLoader("recoverypoint.console", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
environment.filters.update(seconds=seconds, due=due, moment=moment, pretty=pretty)


def secure(response: Response) -> Response:
    response.headers.update(HEADERS)
    return response


def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """``template`` rendered for ``request``: with the mount's root for links, the
    visitor, and the CSRF token for its forms."""
    root = str(request.scope.get("root_path", ""))
    html = environment.get_template(template).render(
        request=request,
        root=root,
        here=request.url.path[len(root) :] or "/",
        visitor=getattr(request.state, "visitor", None),
        csrf_field=csrf.FIELD,
        csrf_token=csrf.token(request),
        **context,
    )
    response = HTMLResponse(html, status_code=status)
    csrf.set_cookie(request, response)
    return secure(response)


def problem(request: Request, status: int, title: str, detail: str) -> Response:
    """An error page: a title and a sentence, never an exception's text or a query."""
    return page(request, "error.html", status, title=title, detail=detail)
