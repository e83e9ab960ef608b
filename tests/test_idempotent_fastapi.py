"""FastAPI with an ``rp.AsyncEngine``: async phased routes and async single-step endpoints
run on the event loop (no thread hop), sync ones on the sync engine as before; served by
uvicorn on loopback, on a real database."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI, Request, Response
from http_servers import serve_asgi
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.integrations import fastapi as rp_fastapi


class Order(BaseModel):
    item: str


# Where each piece of work ran: the thread's ident, by what ran.
RAN_IN: dict[str, list[int]] = {"loop": [], "step": [], "single": [], "sync_single": []}


def async_operation() -> rp.Operation[Order]:
    op = rp.Operation(f"fastapi_async_{uuid.uuid4().hex[:8]}", params=Order)

    @op.atomic_phase("created")
    async def create(tx: Any, order: Order) -> None:
        row = await (await tx.execute("SELECT %s::text", [order.item])).fetchone()
        tx.state["item"] = row[0]

    @op.foreign_step("sent")
    async def send(step: rp.StepContext, order: Order) -> dict[str, Any]:
        RAN_IN["step"].append(threading.get_ident())
        return {"sent_with": step.downstream_key()[:8]}

    @op.atomic_phase("finished")
    async def finish(tx: Any, order: Order) -> rp.Response:
        return rp.Response(201, {"item": tx.state["item"], "sent_with": tx.state["sent_with"]})

    return op


@pytest.fixture(scope="module")
def server(database_url: str, db: sa.Engine) -> Iterator[str]:
    engine = rp.Engine(db)
    async_engine = rp.AsyncEngine(database_url)
    op = async_operation()
    async_engine.register(op)
    idempotency = rp_fastapi.Idempotency(
        engine, scope=lambda request: request.headers["X-Tenant"], async_engine=async_engine
    )
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.get("/loop")
    async def loop() -> None:
        RAN_IN["loop"].append(threading.get_ident())

    @app.post("/async/phased")
    async def phased(request: Request, order: Order) -> Response:
        return await idempotency.run_async(op, request, order)

    @app.post("/async/single", status_code=201)
    @idempotency.single_step(f"fastapi_single_{uuid.uuid4().hex[:8]}")
    async def single(order: Order) -> dict[str, str]:
        RAN_IN["single"].append(threading.get_ident())
        return {"item": order.item}

    @app.post("/sync/single", status_code=201)
    @idempotency.single_step(f"fastapi_sync_single_{uuid.uuid4().hex[:8]}")
    def sync_single(order: Order) -> dict[str, str]:
        RAN_IN["sync_single"].append(threading.get_ident())
        return {"item": order.item}

    @app.post("/dispose")
    async def dispose() -> None:
        await async_engine.dispose()

    with serve_asgi(app) as url:
        httpx.get(f"{url}/loop")
        yield url
        httpx.post(f"{url}/dispose")


@pytest.mark.parametrize("route", ["/async/phased", "/async/single", "/sync/single"])
def test_answers_once_and_replays(server: str, scope: str, route: str) -> None:
    headers = {"Idempotency-Key": uuid.uuid4().hex, "X-Tenant": scope}
    first = httpx.post(f"{server}{route}", json={"item": "tea"}, headers=headers)
    again = httpx.post(f"{server}{route}", json={"item": "tea"}, headers=headers)
    other = httpx.post(f"{server}{route}", json={"item": "coffee"}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json() and first.json()["item"] == "tea"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert other.status_code == 422  # the key with another body


def test_async_work_runs_on_the_event_loop_and_sync_work_in_threads(
    server: str, scope: str
) -> None:
    for route in ("/async/phased", "/async/single", "/sync/single"):
        headers = {"Idempotency-Key": uuid.uuid4().hex, "X-Tenant": scope}
        assert httpx.post(f"{server}{route}", json={"item": "x"}, headers=headers).is_success
    [loop] = set(RAN_IN["loop"])
    assert RAN_IN["step"] and set(RAN_IN["step"]) == {loop}
    assert RAN_IN["single"] and set(RAN_IN["single"]) == {loop}
    assert RAN_IN["sync_single"] and loop not in RAN_IN["sync_single"]
