"""One small service on FastAPI and on Flask, for the HTTP tests.

Routes: ``POST /sync/orders`` runs the phased operation ``http_order``; ``POST /sync/single``
is a single-step endpoint; the FastAPI app has ``/async/...`` twins of both. The scope is
the ``X-Tenant`` header (401 without it). More single-step endpoints, each doing
:func:`single_step_work` first:

- ``/sync/accounts/{account}/orders`` (phased) and ``.../single``: a path parameter;
- ``/sync/body/{kind}``: answers the body :func:`exact_body` makes, with a Content-Digest;
- ``/sync/refuse/{status}``: answers ``status`` by raising the framework's HTTP error
  (Flask has an error handler for 409, none for others);
- FastAPI only, sync and async: ``/{sync,async}/authed`` has an auth dependency (401 unless
  ``Authorization: Bearer good``); ``/{sync,async}/background`` adds a background task that
  notes (:meth:`Gates.note`) the key's stored status as it sees it, and fails for items
  that start with ``bgfail``; ``/sync/lease`` has a 1 s lease and holds its first run of
  every item until released, then adds the same background task (``?stream=true``: it
  answers with a StreamingResponse).

The body is :class:`Order`; its ``item`` steers what happens, by prefix:

- ``fail``: a phase (or the endpoint) raises with a secret in the message;
- ``flaky``: the endpoint fails its first run only;
- ``transient``: a foreign step (or the endpoint) raises ``rp.Retryable`` with internal detail;
- ``hold``: waits, once claimed, until the test releases it (:class:`Gates`).

Every run of the work inserts a row into ``http_orders``, so a test counts runs per item.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from datetime import timedelta
from typing import Annotated, Any

import anyio.to_thread
import flask
import sqlalchemy as sa
from fastapi import BackgroundTasks, Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
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
        self._notes: dict[str, list[Any]] = {}

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

    def note(self, item: str, value: Any) -> None:
        with self._lock:
            self._notes.setdefault(item, []).append(value)

    def notes(self, item: str) -> list[Any]:
        with self._lock:
            return list(self._notes.get(item, ()))


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


# Bodies a JSON round trip would change (key order, number forms, NaN, \u0000) or that are
# not JSON or not text at all; a replay must carry them byte for byte.
EXACT_BODIES: dict[str, tuple[bytes, str]] = {
    "unsorted": (b'{"z":1,"a":[1e16,1E+16,0.10,-0.0],"m":{"y":1,"b":2}}', "application/json"),
    "nan": (b'{"x":NaN,"y":Infinity,"z":-Infinity}', "application/json"),
    "nul-escape": (b'{"a":"\\u0000"}', "application/json"),
    "nul-byte": (b"text with a NUL \x00 byte", "text/plain; charset=utf-8"),
    "binary": (bytes(range(256)), "application/octet-stream"),
}


def exact_body(kind: str, order_id: int) -> tuple[bytes, str]:
    """The body of ``/sync/body/{kind}`` and its media type, with the order id in it."""
    body, media_type = EXACT_BODIES[kind]
    if body.startswith(b"{"):
        return b'{"order_id":%d,' % order_id + body[1:], media_type
    return b"%d " % order_id + body, media_type


def content_digest(body: bytes) -> str:
    """The ``Content-Digest`` (RFC 9530) of ``body``."""
    return f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"


def key_status(db: sa.Engine, scope: str) -> int | None:
    """The response status stored under the scope's key; ``None`` while unfinished."""
    with db.connect() as conn:
        status: int | None = conn.scalar(
            sa.text("SELECT response_status FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        )
    return status


def current_user(request: Request) -> str:
    """The auth dependency of ``/{sync,async}/authed``."""
    if request.headers.get("Authorization") != "Bearer good":
        raise HTTPException(401, "bad token", {"WWW-Authenticate": "Bearer"})
    return "good"


# At module level: FastAPI resolves the endpoints' (string) annotations in this namespace.
User = Annotated[str, Depends(current_user)]


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

    @app.post("/sync/accounts/{account}/orders")
    def account_orders(account: str, request: Request, order: Order) -> Response:
        return idempotency.run(op, request, order)

    @app.post("/sync/accounts/{account}/single", status_code=201)
    @idempotency.single_step("http_single_account")
    def account_single(account: str, order: Order) -> dict[str, Any]:
        return single_step_work(engine.db, gates, order)

    @app.post("/sync/body/{kind}")
    @idempotency.single_step("http_single_body")
    def exact(kind: str, order: Order) -> Response:
        order_id = single_step_work(engine.db, gates, order)["order_id"]
        if kind == "nul-escape":  # as FastAPI writes it
            answer: Response = JSONResponse({"order_id": order_id, "a": "\x00"})
        else:
            content, media_type = exact_body(kind, order_id)
            answer = Response(content, media_type=media_type)
        answer.headers["Content-Digest"] = content_digest(answer.body)
        return answer

    @app.post("/sync/refuse/{status}")
    @idempotency.single_step("http_single_refuse")
    def refuse(status: int, order: Order) -> None:
        single_step_work(engine.db, gates, order)
        raise HTTPException(status, f"refused with {status}")

    @app.post("/sync/authed", status_code=201)
    @idempotency.single_step("http_single_authed_sync")
    def sync_authed(order: Order, user: User) -> dict[str, Any]:
        return single_step_work(engine.db, gates, order)

    @app.post("/async/authed", status_code=201)
    @idempotency.single_step("http_single_authed_async")
    async def async_authed(order: Order, user: User) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(single_step_work, engine.db, gates, order)

    def note_key_status(item: str, scope: str) -> None:
        gates.note(item, key_status(engine.db, scope))
        if item.startswith("bgfail"):
            raise RuntimeError("the background task broke")

    def add_note(request: Request, tasks: BackgroundTasks, order: Order) -> None:
        tasks.add_task(note_key_status, order.item, request.headers["X-Tenant"])

    @app.post("/sync/background", status_code=201)
    @idempotency.single_step("http_single_background_sync")
    def sync_background(request: Request, order: Order, tasks: BackgroundTasks) -> Any:
        add_note(request, tasks, order)
        return single_step_work(engine.db, gates, order)

    @app.post("/async/background", status_code=201)
    @idempotency.single_step("http_single_background_async")
    async def async_background(request: Request, order: Order, tasks: BackgroundTasks) -> Any:
        add_note(request, tasks, order)
        return await anyio.to_thread.run_sync(single_step_work, engine.db, gates, order)

    @app.post("/sync/lease", status_code=201)
    @idempotency.single_step("http_single_lease", lock_timeout=timedelta(seconds=1))
    def lease(request: Request, order: Order, tasks: BackgroundTasks, stream: bool = False) -> Any:
        body = single_step_work(engine.db, gates, order)
        if gates.first_run(order.item):
            gates.hold(order.item)
        add_note(request, tasks, order)
        if stream:  # Starlette listens for the client's disconnect while it streams
            chunks = [b'{"order_id":', str(body["order_id"]).encode(), b"}"]
            return StreamingResponse(iter(chunks), 201, media_type="application/json")
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
        return idempotency.run(op)  # the params: the request's body

    @app.post("/sync/single")
    @idempotency.single_step("http_single_flask")
    def sync_single() -> tuple[dict[str, Any], int, dict[str, str]]:
        body = single_step_work(engine.db, gates, Order.model_validate(flask.request.get_json()))
        return body, 201, {"X-Order": str(body["order_id"]), "Set-Cookie": "session=secret"}

    def order() -> Order:
        return Order.model_validate(flask.request.get_json())

    @app.post("/sync/accounts/<account>/orders")
    def account_orders(account: str) -> flask.Response:
        return idempotency.run(op, flask.request.get_json())

    @app.post("/sync/accounts/<account>/single")
    @idempotency.single_step("http_single_flask_account")
    def account_single(account: str) -> tuple[dict[str, Any], int]:
        return single_step_work(engine.db, gates, order()), 201

    @app.post("/sync/body/<kind>")
    @idempotency.single_step("http_single_flask_body")
    def exact(kind: str) -> flask.Response:
        order_id = single_step_work(engine.db, gates, order())["order_id"]
        if kind in ("nan", "nul-escape"):  # as Flask's jsonify writes them
            value = {"x": float("nan"), "y": float("inf")} if kind == "nan" else {"a": "\x00"}
            answer = flask.jsonify({"order_id": order_id, **value})
        else:
            content, media_type = exact_body(kind, order_id)
            answer = flask.Response(content, content_type=media_type)
        answer.headers["Content-Digest"] = content_digest(answer.get_data())
        return answer

    @app.post("/sync/refuse/<int:status>")
    @idempotency.single_step("http_single_flask_refuse")
    def refuse(status: int) -> None:
        single_step_work(engine.db, gates, order())
        flask.abort(status, f"refused with {status}")

    @app.errorhandler(409)
    def conflict(error: Exception) -> tuple[dict[str, Any], int]:
        return {"title": "conflict", "detail": str(error)}, 409

    return app
