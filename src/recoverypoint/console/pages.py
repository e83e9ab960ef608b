"""The pages that only read: overview, keys, a key, staged jobs, the audit trail. Every
query is the admin layer's, the one ``recoverypoint keys|jobs`` runs, in a thread (the
database calls block); every listing pages by keyset (``before`` an id), never OFFSET."""

from __future__ import annotations

import dataclasses
from importlib.resources import files

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import admin
from ..admin.doctor import WORKERS
from . import csrf, forms
from .auth import REVEAL, require
from .chart import hours_chart
from .render import page, secure
from .site import REVEAL_COOKIE, Site, guarded


@guarded
async def overview(site: Site, request: Request) -> Response:
    await site.visitor(request)
    figures = await run_in_threadpool(admin.overview, site.admin)
    return page(
        request,
        "overview.html",
        overview=figures,
        chart=hours_chart(figures.hours),
        worker_kinds=WORKERS,
    )


@guarded
async def keys(site: Site, request: Request) -> Response:
    visitor = await site.visitor(request)
    selection = forms.key_selection(request.query_params, may_filter_scope=visitor.reveal)
    # One more than a page: whether there is an older page, without counting the rest.
    wanted = dataclasses.replace(selection.filter, limit=(selection.filter.limit or 50) + 1)
    found = await run_in_threadpool(admin.list_keys, site.admin, wanted, reveal=visitor.reveal)
    shown = found[: selection.filter.limit]
    return page(
        request,
        "keys.html",
        selection=selection,
        rows=shown,
        older=shown[-1].id if len(found) > len(shown) else None,
        states=admin.STATES,
        since_choices=forms.SINCE,
        page_sizes=forms.PAGE_SIZES,
        operations=sorted({op.name for op in site.admin.operations}),
        bulk=not dataclasses.replace(selection.filter, before=None).is_empty(),
    )


@guarded
async def key(site: Site, request: Request) -> Response:
    visitor = await site.visitor(request)
    key_id = forms.row_id(request.path_params["key_id"])
    detail = await run_in_threadpool(admin.find_key, site.admin, key_id, reveal=visitor.reveal)
    return page(request, "key.html", detail=detail, row=detail.row,
                available=admin.available(detail.row))  # fmt: skip


@guarded
async def jobs(site: Site, request: Request) -> Response:
    await site.visitor(request)
    selection = forms.job_selection(request.query_params)
    wanted = dataclasses.replace(selection.filter, limit=51)
    found = await run_in_threadpool(admin.list_jobs, site.admin, wanted)
    shown = found[:50]
    older = shown[-1].id if len(found) > len(shown) else None
    return page(request, "jobs.html", selection=selection, jobs=shown, older=older)


@guarded
async def audit(site: Site, request: Request) -> Response:
    await site.visitor(request)
    before = forms.number(request.query_params, "before")
    found = await run_in_threadpool(admin.audit_entries, site.admin, before=before, limit=51)
    shown = found[:50]
    older = shown[-1].id if len(found) > len(shown) else None
    return page(request, "audit.html", entries=shown, older=older)


@guarded
async def audit_entry(site: Site, request: Request) -> Response:
    await site.visitor(request)
    entry_id = forms.row_id(request.path_params["entry_id"])
    entry = await run_in_threadpool(admin.find_audit_entry, site.admin, entry_id)
    return page(request, "audit_entry.html", entry=entry)


@guarded
async def reveal(site: Site, request: Request) -> Response:
    """Turn unmasked scopes and params on or off for this browser (a POST, with CSRF)."""
    await site.visitor(request)
    fields = await csrf.checked_form(request)
    show = forms.flag(fields, "show")
    if show:
        await require(site.authorize, request, REVEAL)
    response = RedirectResponse(_back(request, forms.text(fields, "next")), status_code=303)
    if show:
        response.set_cookie(REVEAL_COOKIE, "1", path=csrf.cookie_path(request),
                            httponly=True, samesite="strict")  # fmt: skip
    else:
        response.delete_cookie(REVEAL_COOKIE, path=csrf.cookie_path(request))
    return secure(response)


async def stylesheet(request: Request) -> Response:
    css = files("recoverypoint.console").joinpath("static/console.css").read_text()
    response = Response(css, media_type="text/css")
    response.headers.update({"Cache-Control": "max-age=3600", "X-Content-Type-Options": "nosniff"})
    return response


def _back(request: Request, target: str | None) -> str:
    """A page of this console to go back to: a path under its root, never another site."""
    root = str(request.scope.get("root_path", ""))
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        target = "/"
    return root + target
