"""Retry, release, abandon, reopen: on one key, or in bulk on the keys a filter selects.

Each is two requests. A GET shows what will change, from a dry run of the admin action
(the CLI's ``--dry-run``): nothing is written. Its form POSTs back, with the CSRF token,
and runs the same admin action, fenced as the CLI's: a key that moved on since it was
read is left alone. A bulk POST acts only on the keys its confirmation listed that the
filters still select. Either ends on the action's audit entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import admin
from . import csrf, forms
from .auth import Forbidden
from .render import page, secure
from .site import Site, Visitor, guarded


@dataclass(frozen=True)
class Action:
    name: str
    verb: str
    done: str
    effect: str
    """What it does to each key, said on the confirmation page."""
    run: Callable[..., admin.ActionResult]


ACTIONS = {
    action.name: action
    for action in (
        Action(
            "retry",
            "Retry",
            "retried",
            "Due now: the completer's next pass (or the client's next retry) runs it on "
            "from its recovery point. Committed phases are not run again.",
            admin.retry,
        ),
        Action(
            "release",
            "Release",
            "released",
            "Its expired lease is cleared: the next retry takes the key at once. A live "
            "lease is never released here.",
            admin.release,
        ),
        Action(
            "abandon",
            "Abandon",
            "abandoned",
            "Finished with a stored error response: every retry of it replays that "
            "response, and no phase runs again.",
            admin.abandon,
        ),
        Action(
            "reopen",
            "Reopen",
            "reopened",
            "Its stored error response is dropped; it is unfinished again, due now, with "
            "its attempts counted from zero, at the recovery point it stopped at.",
            admin.reopen,
        ),
    )
}


def _action(request: Request) -> Action:
    found = ACTIONS.get(request.path_params["action"])
    if found is None:
        raise admin.NotFound("there is no such action")
    return found


async def _operator(site: Site, request: Request, action: Action) -> Visitor:
    visitor = await site.visitor(request)
    if f"keys.{action.name}" not in visitor.may:
        raise Forbidden(action.name)
    return visitor


def _options(action: Action, fields: FormData | None) -> dict[str, Any]:
    """The action's own options from its form; without one, the defaults the
    confirmation shows."""
    sent: FormData = fields if fields is not None else FormData()
    if action.name == "retry":
        return {"reset_attempts": forms.flag(sent, "reset_attempts")}
    if action.name == "abandon":
        status = forms.number(sent, "response_status", low=400, high=599)
        message = forms.text(sent, "message", limit=forms.MAX_MESSAGE)
        return {
            "status": status or admin.DEFAULT_ABANDON_STATUS,
            "message": message or admin.DEFAULT_ABANDON_MESSAGE,
        }
    return {}


@guarded
async def confirm_one(site: Site, request: Request) -> Response:
    action = _action(request)
    visitor = await _operator(site, request, action)
    key_id = forms.row_id(request.path_params["key_id"])
    detail = await run_in_threadpool(admin.find_key, site.admin, key_id, reveal=visitor.reveal)
    refusal = None
    try:
        await run_in_threadpool(lambda: action.run(site.admin, key_id, dry_run=True))
    except admin.Refused as exc:
        refusal = str(exc)
    return page(request, "confirm.html", 200 if refusal is None else 409, action=action,
                row=detail.row, refusal=refusal, bulk=None,
                defaults=_options(action, None), effects=admin.ABANDON_EFFECTS)  # fmt: skip


@guarded
async def act_one(site: Site, request: Request) -> Response:
    action = _action(request)
    visitor = await _operator(site, request, action)
    fields = await csrf.checked_form(request)
    return await _perform(
        site, request, visitor, action, forms.row_id(request.path_params["key_id"]), fields
    )


@guarded
async def confirm_bulk(site: Site, request: Request) -> Response:
    action = _action(request)
    visitor = await _operator(site, request, action)
    selection = _bulk_selection(request.query_params, visitor)
    result = await run_in_threadpool(lambda: action.run(site.admin, selection.filter, dry_run=True))
    return page(request, "confirm.html", action=action, row=None, refusal=None,
                bulk=result, selection=selection, ids=forms.joined(result.eligible),
                limit=forms.BULK_LIMIT, defaults=_options(action, None),
                effects=admin.ABANDON_EFFECTS)  # fmt: skip


@guarded
async def act_bulk(site: Site, request: Request) -> Response:
    action = _action(request)
    visitor = await _operator(site, request, action)
    fields = await csrf.checked_form(request)
    selection = _bulk_selection(fields, visitor)
    listed = forms.ids(fields)
    # The keys the confirmation listed, if the filters still select them.
    target = dataclasses.replace(selection.filter, ids=listed, limit=len(listed))
    return await _perform(site, request, visitor, action, target, fields)


def _bulk_selection(fields: forms.Fields, visitor: Visitor) -> forms.KeySelection:
    selection = forms.key_selection(fields, may_filter_scope=visitor.reveal, bulk=True)
    if selection.filter.is_empty():
        raise forms.FormError("choose a filter first: a bulk action never takes every key")
    return selection


async def _perform(
    site: Site,
    request: Request,
    visitor: Visitor,
    action: Action,
    target: int | admin.KeyFilter,
    fields: FormData,
) -> Response:
    """Run the action as the visitor, then show its audit entry."""
    options = _options(action, fields)
    result = await run_in_threadpool(lambda: action.run(site.acting(visitor), target, **options))
    root = str(request.scope.get("root_path", ""))
    return secure(RedirectResponse(f"{root}/audit/{result.audit_id}", status_code=303))
