"""A FastAPI and a Flask service for the integrations' choices: header names, stored status
classes, optional keys and scopes (tests/test_http_choices.py).

Every route does its work as one row of ``choice_runs`` (its ``item`` from the JSON body),
so a test counts runs per item. The scope is the ``X-Tenant`` header.

- ``/answer/{status}``: single-step, answers ``status``; its integration reads the key
  from ``X-Request-Key``, marks replays with ``X-Was-Replayed`` and stores 2xx to 4xx;
- ``/optional``, ``/optional-phased``: the same integration, the key optional (single-step
  and phased);
- ``/unscoped/{status}``: single-step, ``scope=UNSCOPED`` and every default;
- ``/empty``, ``/empty-phased``: a scope function that returns ``""``;
- ``/held``: single-step, on an integration with ``wait=``; an item held with
  :meth:`Holds.hold` stops inside its first run until released.
"""

from __future__ import annotations

import threading
from typing import Any

import flask
import sqlalchemy as sa
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.integrations import flask as rp_flask

SCHEMA = """
CREATE TABLE IF NOT EXISTS choice_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item text NOT NULL
);
"""

WAIT = 30  # seconds; the lease (90 s) outlasts it

KEY_HEADER = "X-Request-Key"
REPLAYED_HEADER = "X-Was-Replayed"


class Item(BaseModel):
    item: str


class Holds:
    """Items whose first run stops until the test releases it."""

    def __init__(self) -> None:
        self.entered: dict[str, threading.Event] = {}
        self.released: dict[str, threading.Event] = {}

    def hold(self, item: str) -> None:
        self.entered[item], self.released[item] = threading.Event(), threading.Event()

    def stop(self, item: str) -> None:
        entered = self.entered.get(item)
        if entered is not None and not entered.is_set():
            entered.set()
            assert self.released[item].wait(60), "never released"


HOLDS = Holds()


def work(db: sa.Engine, item: str) -> int:
    """One run: a row of ``choice_runs``; the number of runs of ``item`` so far."""
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO choice_runs (item) VALUES (:i)"), {"i": item})
        runs: int = conn.scalar(
            sa.text("SELECT count(*) FROM choice_runs WHERE item = :i"), {"i": item}
        )
    return runs


def operation(name: str) -> rp.Operation[Item]:
    op = rp.Operation(name, params=Item)

    @op.atomic_phase("finished")
    def finished(tx: rp.AtomicContext, params: Item) -> rp.Response:
        tx.connection.execute(
            sa.text("INSERT INTO choice_runs (item) VALUES (:i)"), {"i": params.item}
        )
        return rp.Response(201, {"item": params.item})

    return op


def empty_scope(request: Any) -> str:
    return ""


def fastapi_app(engine: rp.Engine) -> FastAPI:
    def tenant(request: Request) -> str:
        return request.headers.get("X-Tenant", "nobody")

    chosen = rp_fastapi.Idempotency(
        engine,
        scope=tenant,
        key_header=KEY_HEADER,
        replayed_header=REPLAYED_HEADER,
        stored_classes=(2, 3, 4),
    )
    shared = rp_fastapi.Idempotency(engine, scope=UNSCOPED)
    empty = rp_fastapi.Idempotency(engine, scope=empty_scope)
    waiting = rp_fastapi.Idempotency(engine, scope=tenant, wait=WAIT)
    optional_op, empty_op = operation("choice_optional_fastapi"), operation("choice_empty_fastapi")
    engine.register(optional_op, empty_op)
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    def answer(status: int, body: Item) -> Response:
        return JSONResponse({"item": body.item, "runs": work(engine.db, body.item)}, status)

    @app.post("/answer/{status}")
    @chosen.single_step("choice_answer_fastapi")
    def chosen_answer(status: int, body: Item) -> Response:
        return answer(status, body)

    @app.post("/optional")
    @chosen.single_step("choice_optional_single_fastapi", key_required=False)
    async def optional(body: Item) -> Response:
        return answer(200, body)

    @app.post("/optional-phased")
    def optional_phased(request: Request, body: Item) -> Response:
        return chosen.run(optional_op, request, body, key_required=False)

    @app.post("/unscoped/{status}")
    @shared.single_step("choice_unscoped_fastapi")
    def unscoped(status: int, body: Item) -> Response:
        return answer(status, body)

    @app.post("/empty")
    @empty.single_step("choice_empty_single_fastapi")
    def empty_single(body: Item) -> Response:
        return answer(200, body)

    @app.post("/empty-phased")
    def empty_phased(request: Request, body: Item) -> Response:
        return empty.run(empty_op, request, body)

    @app.post("/held")
    @waiting.single_step("choice_held_fastapi")
    def held(body: Item) -> Response:
        HOLDS.stop(body.item)
        return answer(201, body)

    return app


def flask_app(engine: rp.Engine) -> flask.Flask:
    def tenant(request: flask.Request) -> str:
        return request.headers.get("X-Tenant", "nobody")

    chosen = rp_flask.Idempotency(
        engine,
        scope=tenant,
        key_header=KEY_HEADER,
        replayed_header=REPLAYED_HEADER,
        stored_classes=(2, 3, 4),
    )
    shared = rp_flask.Idempotency(engine, scope=UNSCOPED)
    empty = rp_flask.Idempotency(engine, scope=empty_scope)
    waiting = rp_flask.Idempotency(engine, scope=tenant, wait=WAIT)
    optional_op, empty_op = operation("choice_optional_flask"), operation("choice_empty_flask")
    engine.register(optional_op, empty_op)
    app = flask.Flask("choices")

    def answer(status: int) -> tuple[dict[str, Any], int]:
        item = str(flask.request.get_json()["item"])
        return {"item": item, "runs": work(engine.db, item)}, status

    @app.post("/answer/<int:status>")
    @chosen.single_step("choice_answer_flask")
    def chosen_answer(status: int) -> tuple[dict[str, Any], int]:
        return answer(status)

    @app.post("/optional")
    @chosen.single_step("choice_optional_single_flask", key_required=False)
    def optional() -> tuple[dict[str, Any], int]:
        return answer(200)

    @app.post("/optional-phased")
    def optional_phased() -> flask.Response:
        return chosen.run(optional_op, key_required=False)

    @app.post("/unscoped/<int:status>")
    @shared.single_step("choice_unscoped_flask")
    def unscoped(status: int) -> tuple[dict[str, Any], int]:
        return answer(status)

    @app.post("/empty")
    @empty.single_step("choice_empty_single_flask")
    def empty_single() -> tuple[dict[str, Any], int]:
        return answer(200)

    @app.post("/empty-phased")
    def empty_phased() -> flask.Response:
        return empty.run(empty_op)

    @app.post("/held")
    @waiting.single_step("choice_held_flask")
    def held() -> tuple[dict[str, Any], int]:
        HOLDS.stop(str(flask.request.get_json()["item"]))
        return answer(201)

    return app
