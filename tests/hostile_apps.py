"""The services tests/test_hostile.py throws hostile input at: one phased operation, a
FastAPI app and a Flask app, each with phased routes and single-step endpoints.

The scope is the ``X-Tenant`` header (401 without it). Every run of an endpoint and every
committed run of the operation's first phase is counted per tenant in :data:`RUNS`, so a
test tells how often its request did work; tests use a fresh tenant per example.

Routes, on both frameworks unless noted (``{tail}`` is any path, so paths can be hostile):

- ``POST /phased/{tail}``: the phased operation with the JSON body as its params
  (``/phased-async/{tail}`` is the async FastAPI twin);
- ``POST /single/echo``: single-step; answers 201 with the request body and its
  Content-Type, as the endpoint got them, and the ``X-Request-Id`` header, if sent;
- ``POST /single/json``: single-step; answers 201 with a small JSON object of its own;
- ``POST /single/typed`` (FastAPI): single-step, the body validated as :class:`Item`;
- ``POST /single/refuse``: single-step; refuses with the framework's own 409.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextvars import ContextVar
from typing import Annotated, Any

import flask
import sqlalchemy as sa
from fastapi import Body, FastAPI, HTTPException, Request, Response
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.integrations import flask as rp_flask

TENANT = "X-Tenant"
REQUEST_ID = "X-Request-Id"

# The tenant of the request being served, for the operation's phases (which only get the
# params); the routes set it, and the engine runs the phases in the same context.
CURRENT: ContextVar[str | None] = ContextVar("hostile_tenant", default=None)


class Runs:
    """How often each tenant's work ran; thread-safe. A single-step endpoint's runs are
    counted here; the operation's first phase counts its own in the database
    (:meth:`bind`), in its transaction: a phase retried after a serialization failure ran
    twice, but its work, rolled back once, was done once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._db: sa.Engine | None = None

    def bind(self, db: sa.Engine) -> None:
        """Count the phases' runs in ``db``, the database the operation runs on."""
        with db.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS hostile_runs (tenant text NOT NULL)"))
        self._db = db

    def hit(self, tenant: str | None) -> int:
        with self._lock:
            self._counts[tenant or "?"] += 1
            return self._counts[tenant or "?"]

    def __getitem__(self, tenant: str) -> int:
        with self._lock:
            hits = self._counts[tenant]
        if self._db is None or not storable(tenant):
            return hits  # a tenant the database cannot hold has no phase that committed
        with self._db.connect() as conn:
            committed = conn.scalar(
                sa.text("SELECT count(*) FROM hostile_runs WHERE tenant = :t"), {"t": tenant}
            )
        return hits + int(committed)


def storable(text: str) -> bool:
    """Whether PostgreSQL's text can hold ``text``: no NUL, no lone surrogate."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


RUNS = Runs()


class Item(BaseModel):
    name: str
    quantity: int = 1


def echo_operation(name: str = "hostile_echo") -> rp.Operation[Any]:
    """Three phases; the answer names the tenant, counts the run and echoes the params."""
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("received")
    def received(tx: rp.AtomicContext, params: Any) -> None:
        tenant = CURRENT.get()
        tx.state["tenant"] = tenant
        tx.execute("INSERT INTO hostile_runs (tenant) VALUES (%s)", [tenant])
        tx.state["run"] = tx.scalar("SELECT count(*) FROM hostile_runs WHERE tenant = %s", [tenant])

    @op.foreign_step("noted")
    def noted(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {"noted": True}

    @op.atomic_phase("finished")
    def finished(tx: rp.AtomicContext, params: Any) -> rp.Response:
        body = {"tenant": tx.state["tenant"], "run": tx.state["run"], "params": params}
        return rp.Response(201, body, {"X-Run": str(tx.state["run"])})

    return op


def fastapi_app(engine: rp.Engine, op: rp.Operation[Any]) -> FastAPI:
    def tenant_of(request: Request) -> str:
        name = request.headers.get(TENANT)
        if not name:
            raise HTTPException(401, "send X-Tenant")
        return name

    idempotency = rp_fastapi.Idempotency(engine, scope=tenant_of)
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.post("/phased/{tail:path}")
    def phased(request: Request, tail: str, body: Annotated[Any, Body()] = None) -> Response:
        CURRENT.set(tenant_of(request))
        return idempotency.run(op, request, body)

    @app.post("/phased-async/{tail:path}")
    async def phased_async(
        request: Request, tail: str, body: Annotated[Any, Body()] = None
    ) -> Response:
        CURRENT.set(tenant_of(request))
        return await idempotency.run_async(op, request, body)

    @app.post("/single/echo")
    @idempotency.single_step("hostile_fastapi_echo")
    async def single_echo(request: Request) -> Response:
        run = RUNS.hit(request.headers.get(TENANT))
        body = await request.body()
        content_type = request.headers.get("content-type") or "application/octet-stream"
        response = Response(body, 201, {"X-Run": str(run)}, media_type=content_type)
        if REQUEST_ID in request.headers:  # echoed, as request ids commonly are
            response.headers[REQUEST_ID] = request.headers[REQUEST_ID]
        return response

    @app.post("/single/json", status_code=201)
    @idempotency.single_step("hostile_fastapi_json")
    async def single_json(request: Request) -> dict[str, Any]:
        run = RUNS.hit(request.headers.get(TENANT))
        body = await request.body()
        return {"tenant": request.headers.get(TENANT), "run": run, "bytes": len(body)}

    @app.post("/single/typed", status_code=201)
    @idempotency.single_step("hostile_fastapi_typed")
    def single_typed(request: Request, item: Item) -> dict[str, Any]:
        run = RUNS.hit(request.headers.get(TENANT))
        return {"tenant": request.headers.get(TENANT), "run": run, "item": item.name}

    @app.post("/single/refuse")
    @idempotency.single_step("hostile_fastapi_refuse")
    def single_refuse(request: Request) -> dict[str, Any]:
        RUNS.hit(request.headers.get(TENANT))
        raise HTTPException(409, "this order was already placed")

    return app


def flask_app(engine: rp.Engine, op: rp.Operation[Any]) -> flask.Flask:
    def tenant_of(request: flask.Request) -> str:
        name = request.headers.get(TENANT)
        if not name:
            flask.abort(401)
        return name

    idempotency = rp_flask.Idempotency(engine, scope=tenant_of)
    app = flask.Flask("hostile_tests")
    # Answer errors as a deployed app would (a 500 page), not by raising into the test.
    app.config["PROPAGATE_EXCEPTIONS"] = False

    @app.post("/phased/<path:tail>")
    def phased(tail: str) -> flask.Response:
        CURRENT.set(tenant_of(flask.request))
        return idempotency.run(op)  # the params: the request body, read safely

    @app.post("/single/echo")
    @idempotency.single_step("hostile_flask_echo")
    def single_echo() -> flask.Response:
        request = flask.request
        run = RUNS.hit(request.headers.get(TENANT))
        content_type = request.headers.get("Content-Type") or "application/octet-stream"
        response = flask.Response(request.get_data(), 201, content_type=content_type)
        response.headers["X-Run"] = str(run)
        if REQUEST_ID in request.headers:  # echoed, as request ids commonly are
            response.headers[REQUEST_ID] = request.headers[REQUEST_ID]
        return response

    @app.post("/single/json")
    @idempotency.single_step("hostile_flask_json")
    def single_json() -> tuple[dict[str, Any], int]:
        request = flask.request
        run = RUNS.hit(request.headers.get(TENANT))
        tenant = request.headers.get(TENANT)
        return {"tenant": tenant, "run": run, "bytes": len(request.get_data())}, 201

    @app.post("/single/refuse")
    @idempotency.single_step("hostile_flask_refuse")
    def single_refuse() -> flask.Response:
        RUNS.hit(flask.request.headers.get(TENANT))
        flask.abort(409)

    return app
