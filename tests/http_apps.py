"""One small service on FastAPI and on Flask, for the HTTP tests.

Routes: ``POST /sync/orders`` runs the phased operation ``http_order``; ``POST /sync/single``
is a single-step endpoint; the FastAPI app has ``/async/...`` twins of both. The scope is
the ``X-Tenant`` header (401 without it). The body is :class:`Order`; its ``item`` steers
what happens, by prefix:

- ``fail``: a phase (or the endpoint) raises with a secret in the message;
- ``flaky``: the endpoint fails its first run only;
- ``transient``: a foreign step (or the endpoint) raises ``rp.Retryable`` with internal detail;
- ``hold``: waits, once claimed, until the test releases it (:class:`Gates`).

Every run of the work inserts a row into ``http_orders``, so a test counts runs per item.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio.to_thread
import flask
import sqlalchemy as sa
from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.integrations import flask as rp_flask

SCHEMA = """
CREATE TABLE IF NOT EXISTS http_orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item text NOT NULL
);
"""

SECRET = "password=hunter2"


class Order(BaseModel):
    item: str
    note: str = ""


class Gates:
    """Holds requests inside their work until a test releases them; remembers first runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, tuple[threading.Event, threading.Event]] = {}
        self._seen: set[str] = set()

    def _pair(self, item: str) -> tuple[threading.Event, threading.Event]:
        with self._lock:
            return self._events.setdefault(item, (threading.Event(), threading.Event()))

    def hold(self, item: str) -> None:
        entered, released = self._pair(item)
        entered.set()
        if not released.wait(30):
            raise TimeoutError(f"{item} was never released")

    def wait_entered(self, item: str) -> bool:
        return self._pair(item)[0].wait(30)

    def release(self, item: str) -> None:
        self._pair(item)[1].set()

    def first_run(self, item: str) -> bool:
        with self._lock:
            first = item not in self._seen
            self._seen.add(item)
            return first


def order_operation(gates: Gates) -> rp.Operation[Order]:
    op = rp.Operation("http_order", params=Order)

    @op.atomic_phase("ordered")
    def ordered(tx: rp.AtomicContext, params: Order) -> None:
        if params.item.startswith("fail"):
            raise RuntimeError(f"the phase broke ({SECRET})")
        tx.state["order_id"] = tx.connection.scalar(
            sa.text("INSERT INTO http_orders (item) VALUES (:item) RETURNING id"),
            {"item": params.item},
        )

    @op.foreign_step("confirmed")
    def confirmed(step: rp.StepContext, params: Order) -> dict[str, Any]:
        if params.item.startswith("hold"):
            gates.hold(params.item)
        if params.item.startswith("transient"):
            raise rp.Retryable(f"the upstream at 10.1.2.3 answered 502 ({SECRET})")
        return {"confirmation": step.downstream_key()}

    @op.atomic_phase("finished")
    def finished(tx: rp.AtomicContext, params: Order) -> rp.Response:
        order_id = tx.state["order_id"]
        headers = {
            "Location": f"/orders/{order_id}",
            "X-Order": str(order_id),
            "Set-Cookie": "session=secret",
            "Keep-Alive": "timeout=99",
        }
        return rp.Response(201, {"order_id": order_id, "item": params.item}, headers)

    return op


def single_step_work(db: sa.Engine, gates: Gates, order: Order) -> dict[str, Any]:
    """What the single-step endpoints do: one write of their own, then their answer."""
    if order.item.startswith("fail"):
        raise RuntimeError(f"the endpoint broke ({SECRET})")
    if order.item.startswith("flaky") and gates.first_run(order.item):
        raise RuntimeError("the endpoint broke, this time only")
    if order.item.startswith("transient"):
        raise rp.Retryable(f"the upstream at 10.1.2.3 answered 502 ({SECRET})")
    with db.begin() as conn:
        order_id = conn.scalar(
            sa.text("INSERT INTO http_orders (item) VALUES (:item) RETURNING id"),
            {"item": order.item},
        )
    if order.item.startswith("hold"):
        gates.hold(order.item)
    return {"order_id": order_id, "item": order.item}


def fastapi_app(engine: rp.Engine, op: rp.Operation[Order], gates: Gates) -> FastAPI:
    def tenant(request: Request) -> str:
        name = request.headers.get("X-Tenant")
        if not name:
            raise HTTPException(401, "send X-Tenant")
        return name

    idempotency = rp_fastapi.Idempotency(engine, scope=tenant)
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.post("/sync/orders")
    def sync_orders(request: Request, order: Order) -> Response:
        return idempotency.run(op, request, order)

    @app.post("/async/orders")
    async def async_orders(request: Request, order: Order) -> Response:
        return await idempotency.run_async(op, request, order)

    @app.post("/sync/single", status_code=201)
    @idempotency.single_step("http_single_sync")
    def sync_single(order: Order, response: Response) -> dict[str, Any]:
        body = single_step_work(engine.db, gates, order)
        response.headers["X-Order"] = str(body["order_id"])
        response.set_cookie("session", "secret")
        return body

    @app.post("/async/single", status_code=201)
    @idempotency.single_step("http_single_async")
    async def async_single(order: Order, response: Response) -> dict[str, Any]:
        body = await anyio.to_thread.run_sync(single_step_work, engine.db, gates, order)
        response.headers["X-Order"] = str(body["order_id"])
        response.set_cookie("session", "secret")
        return body

    return app


def flask_app(engine: rp.Engine, op: rp.Operation[Order], gates: Gates) -> flask.Flask:
    def tenant(request: flask.Request) -> str:
        name = request.headers.get("X-Tenant")
        if not name:
            flask.abort(401)
        return name

    idempotency = rp_flask.Idempotency(engine, scope=tenant)
    app = flask.Flask("http_tests")

    @app.post("/sync/orders")
    def sync_orders() -> flask.Response:
        return idempotency.run(op, flask.request.get_json())

    @app.post("/sync/single")
    @idempotency.single_step("http_single_flask")
    def sync_single() -> tuple[dict[str, Any], int, dict[str, str]]:
        body = single_step_work(engine.db, gates, Order.model_validate(flask.request.get_json()))
        return body, 201, {"X-Order": str(body["order_id"]), "Set-Cookie": "session=secret"}

    return app
