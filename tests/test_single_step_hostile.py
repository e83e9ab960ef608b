"""Single-step FastAPI endpoints, tried as a careless service would set them up, on a real
database: a ``response_model`` that refuses the endpoint's value after its work ran, a
scope function that fails, an operation the engine does not know. Each is answered with a
``problem+json`` that says whose mistake it is; no request runs the endpoint twice."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI, Request
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.integrations import fastapi as rp_fastapi

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


class Order(BaseModel):
    item: str


class Placed(BaseModel):
    order_id: int


def key_row(db: sa.Engine, operation: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT recovery_point, response_status, locked_at FROM idempotency_keys "
                "WHERE operation = :o"
            ),
            {"o": operation},
        ).one_or_none()


def app_with(
    engine: rp.Engine,
    name: str,
    orders: list[str],
    *,
    scope: Callable[[Request], str] = lambda request: "tenant",
    is_async: bool = False,
) -> FastAPI:
    idempotency = rp_fastapi.Idempotency(engine, scope=scope)
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    if is_async:

        @app.post("/orders", response_model=Placed, status_code=201)
        @idempotency.single_step(name)
        async def place_async(order: Order) -> Any:
            orders.append(order.item)
            return {"order_id": "not a number"}  # response_model refuses it

    else:

        @app.post("/orders", response_model=Placed, status_code=201)
        @idempotency.single_step(name)
        def place(order: Order) -> Any:
            orders.append(order.item)
            return {"order_id": "not a number"}

    return app


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_response_model_refusal_after_the_work_is_stored_and_replayed(
    engine: rp.Engine, db: sa.Engine, is_async: bool
) -> None:
    """Three requests used to place three orders, each a 500 inviting a retry."""
    name, orders = f"refused_{uuid.uuid4().hex[:8]}", []
    app = app_with(engine, name, orders, is_async=is_async)
    with TestClient(app, raise_server_exceptions=False) as client:
        answers = [
            client.post("/orders", json={"item": "book"}, headers={"Idempotency-Key": "k"})
            for _ in range(3)
        ]
    assert orders == ["book"]
    assert [a.status_code for a in answers] == [500, 500, 500]
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    for answer in answers:
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"].endswith(":response-failed-validation")
        assert "not done again" in problem["detail"]
        assert "Retry it" not in problem["detail"]
    assert answers[0].content == answers[1].content == answers[2].content
    row = key_row(db, name)
    assert (row.recovery_point, row.response_status, row.locked_at) == ("finished", 500, None)


def test_an_endpoint_that_raises_still_runs_again_on_retry(engine: rp.Engine) -> None:
    """Unchanged: an endpoint's own exception is a failure, not its answer (Stripe's rule)."""
    idempotency = rp_fastapi.Idempotency(engine, scope=lambda request: "tenant")
    app, runs = FastAPI(), []
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.post("/orders", response_model=Placed)
    @idempotency.single_step(f"raises_{uuid.uuid4().hex[:8]}")
    def place(order: Order) -> Any:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("the database of orders is down")
        return {"order_id": 7}

    with TestClient(app, raise_server_exceptions=False) as client:
        first = client.post("/orders", json={"item": "x"}, headers={"Idempotency-Key": "k"})
        second = client.post("/orders", json={"item": "x"}, headers={"Idempotency-Key": "k"})
    assert (first.status_code, second.status_code, second.json()) == (500, 200, {"order_id": 7})
    assert runs == [1, 1]
