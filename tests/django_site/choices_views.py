"""Views of the integration's choices, as FastAPI's and Flask's are tested (test_http_choices):
the key's and the replay marker's header names, the status classes stored, an optional key,
a duplicate that waits, the scope. Each counts its runs in ``RUNS``."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse

import recoverypoint as rp
from examples.django_rides.rides.operations import engine
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations.django import Idempotency

RUNS: Counter[str] = Counter()

KEY_HEADER, REPLAYED_HEADER = "X-Request-Id", "X-Replayed"

renamed = Idempotency(engine, key_header=KEY_HEADER, replayed_header=REPLAYED_HEADER)
no_5xx = Idempotency(engine, stored_classes=(2, 3, 4))
waiting = Idempotency(engine, wait=30)
unscoped = Idempotency(engine, scope=UNSCOPED)
empty = Idempotency(engine, scope=lambda request: "")
default = Idempotency(engine)


def _ran(kind: str, status: int = 201) -> JsonResponse:
    RUNS[kind] += 1
    return JsonResponse({"kind": kind, "run": RUNS[kind], "id": str(uuid.uuid4())}, status=status)


@renamed.single_step("django_choice_renamed")
def renamed_view(request: HttpRequest) -> HttpResponse:
    return _ran("renamed")


@no_5xx.single_step("django_choice_no_5xx")
def failing_view(request: HttpRequest) -> HttpResponse:
    return _ran("failing", status=500)


@no_5xx.single_step("django_choice_no_5xx_404")
def not_found_view(request: HttpRequest) -> HttpResponse:
    RUNS["not_found"] += 1
    raise Http404("no such order")


@default.single_step("django_choice_optional", key_required=False)
def optional_view(request: HttpRequest) -> HttpResponse:
    return _ran("optional")


@default.single_step("django_choice_optional_async", key_required=False)
async def optional_async_view(request: HttpRequest) -> HttpResponse:
    return _ran("optional_async")


noted: rp.Operation[Any] = rp.Operation("django_choice_noted")


@noted.atomic_phase("finished")
def note(tx: rp.AtomicContext, params: Any) -> rp.Response:
    RUNS["optional_phased"] += 1
    return rp.Response(201, {"noted": params, "run": RUNS["optional_phased"]})


engine.register(noted)


def optional_phased_view(request: HttpRequest) -> HttpResponse:
    return default.run(noted, request, key_required=False)


async def optional_phased_async_view(request: HttpRequest) -> HttpResponse:
    return await default.arun(noted, request, key_required=False)


# Held open by the test of a waiting duplicate: ENTERED once the view runs, until RELEASE.
ENTERED, RELEASE = threading.Event(), threading.Event()


@waiting.single_step("django_choice_waited")
def waited_view(request: HttpRequest) -> HttpResponse:
    ENTERED.set()
    RELEASE.wait(timeout=60)
    return _ran("waited")


@unscoped.single_step("django_choice_unscoped")
def unscoped_view(request: HttpRequest) -> HttpResponse:
    return _ran("unscoped")


@empty.single_step("django_choice_empty")
def empty_view(request: HttpRequest) -> HttpResponse:
    return _ran("empty")


# Views made by the test of header names, one per name tried, served at /choices/named/<id>.
NAMED: dict[str, Callable[[HttpRequest], HttpResponse]] = {}


def named_view(request: HttpRequest, view_id: str) -> HttpResponse:
    return NAMED[view_id](request)


def named(key_header: str) -> str:
    """A single-step view whose key is read from ``key_header``; its id in ``NAMED``."""
    view_id = uuid.uuid4().hex
    idempotency = Idempotency(engine, scope=UNSCOPED, key_header=key_header)

    @idempotency.single_step(f"django_choice_named_{view_id}")
    def view(request: HttpRequest) -> HttpResponse:
        RUNS[view_id] += 1
        return HttpResponse(json.dumps({"run": RUNS[view_id], "id": str(uuid.uuid4())}))

    NAMED[view_id] = view
    return view_id
