"""Single-step FastAPI endpoints, tried as a careless service would set them up, on a real
database: a ``response_model`` that refuses the endpoint's value after its work ran, a
scope function that fails, an operation the engine does not know. Each is answered with a
``problem+json`` that says whose mistake it is; no request runs the endpoint twice."""

from __future__ import annotations

import asyncio
import json
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import psycopg
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


# -- configuration mistakes: the service's, not the client's --------------------------------


def finished_op(name: str) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"ok": True})

    return op


def phased_app(engine: rp.Engine, op: rp.Operation[Any], scope: Callable[[Request], str]) -> Any:
    idempotency = rp_fastapi.Idempotency(engine, scope=scope)
    app = FastAPI()

    @app.post("/rides")
    def post_ride(request: Request, body: Order) -> Any:
        return idempotency.run(op, request, body.model_dump())

    return app


def assert_misconfigured(answer: Any, kind: str) -> None:
    """A 500 problem+json that names the kind of mistake and does not invite a retry."""
    text = answer.get_data(as_text=True) if hasattr(answer, "get_data") else answer.text
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/problem+json"
    problem = json.loads(text)
    assert problem["type"] == f"tag:recoverypoint,2025:{kind}"
    assert problem["title"] == "The service is misconfigured"
    assert "retrying it will not help" in problem["detail"]
    assert "Retry it" not in text and "Traceback" not in text


def test_an_unmigrated_database_is_a_configuration_error_at_start_up_and_per_request(
    empty_database_url: str,
) -> None:
    engine = rp.Engine(empty_database_url)
    op = finished_op("unmigrated")
    engine.register(op)
    try:
        with pytest.raises(rp.ConfigurationError, match="recoverypoint migrate"):
            engine.check(op)
        with pytest.raises(rp.ConfigurationError, match="no recoverypoint schema"):
            engine.run(op, key="k", params={})
        app = phased_app(engine, op, lambda request: "tenant")
        with TestClient(app) as client:
            answer = client.post("/rides", json={"item": "x"}, headers={"Idempotency-Key": "k"})
        assert_misconfigured(answer, "configuration-error")
    finally:
        engine.dispose()

    async def run_async() -> None:
        async_engine = rp.AsyncEngine(empty_database_url)
        op_async: rp.Operation[Any] = rp.Operation("unmigrated_async")

        @op_async.atomic_phase("finished")
        async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
            return rp.Response(201)

        async_engine.register(op_async)
        try:
            with pytest.raises(rp.ConfigurationError, match="recoverypoint migrate"):
                await async_engine.check(op_async)
            with pytest.raises(rp.ConfigurationError, match="recoverypoint migrate"):
                await async_engine.run(op_async, key="k", params={})
        finally:
            await async_engine.dispose()

    asyncio.run(run_async())


@pytest.mark.parametrize("namespace", [None, "given"], ids=["namespace-read", "namespace-given"])
def test_an_unmigrated_database_met_first_by_a_request_is_a_configuration_error(
    empty_database_url: str, namespace: str | None
) -> None:
    """No check() at start-up: the first request, on either engine, is told to migrate,
    not handed the driver's UndefinedTable, whether it meets the missing schema reading
    the namespace or (a namespace given to the engine) in its claim."""
    engine = rp.Engine(empty_database_url, namespace=namespace)
    op = finished_op("unmigrated_first")
    engine.register(op)
    try:
        with pytest.raises(rp.ConfigurationError, match="recoverypoint migrate"):
            engine.run(op, key="k", params={})
    finally:
        engine.dispose()

    async def run_async() -> None:
        async_engine = rp.AsyncEngine(empty_database_url, namespace=namespace)
        op_async: rp.Operation[Any] = rp.Operation("unmigrated_first_async")

        @op_async.atomic_phase("finished")
        async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
            return rp.Response(201)

        async_engine.register(op_async)
        try:
            with pytest.raises(rp.ConfigurationError, match="recoverypoint migrate"):
                await async_engine.run(op_async, key="k", params={})
        finally:
            await async_engine.dispose()

    asyncio.run(run_async())


def test_a_schema_at_an_older_revision_is_a_configuration_error(empty_database_url: str) -> None:
    from alembic.script import ScriptDirectory

    from recoverypoint import migrate

    migrate.upgrade(empty_database_url)
    revisions = [
        r.revision for r in ScriptDirectory(str(migrate.migrations_dir())).walk_revisions()
    ]
    engine = rp.Engine(empty_database_url)
    try:
        engine.check()  # at head
        with engine.db.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = :r"),
                {"r": revisions[1]},  # the one before the head
            )
        with pytest.raises(rp.ConfigurationError, match=f"revision {revisions[1]}"):
            engine.check()
        with engine.db.begin() as conn:
            conn.execute(sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'newer'"))
        engine.check()  # a newer recoverypoint migrated it: its schema holds this one's
    finally:
        engine.dispose()


def test_a_phase_querying_a_missing_table_of_its_own_is_not_a_configuration_error(
    engine: rp.Engine,
) -> None:
    op: rp.Operation[Any] = rp.Operation(f"own_table_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute("SELECT * FROM no_such_table_of_the_application")
        return rp.Response(200)

    engine.register(op)
    with pytest.raises(psycopg.errors.UndefinedTable):
        engine.run(op, key="k", params={}, scope=uuid.uuid4().hex)


def test_an_unregistered_operation_is_found_at_start_up_and_answered_as_misconfigured(
    engine: rp.Engine,
) -> None:
    op = finished_op(f"unregistered_{uuid.uuid4().hex[:8]}")
    with pytest.raises(rp.OperationNotRegistered):
        engine.check(op)
    with TestClient(phased_app(engine, op, lambda request: "tenant")) as client:
        answer = client.post("/rides", json={"item": "x"}, headers={"Idempotency-Key": "k"})
    assert_misconfigured(answer, "operation-not-registered")


def test_a_single_step_scope_from_request_state_is_a_clear_configuration_error(
    engine: rp.Engine, db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The scope of a single-step endpoint runs in the middleware, before the dependency
    that sets request.state: every request used to get a text/plain 500."""
    name, orders = f"state_scope_{uuid.uuid4().hex[:8]}", []

    def user_of(request: Request) -> str:
        return str(request.state.user_id)

    app = app_with(engine, name, orders, scope=user_of)
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/orders", json={"item": "x"}, headers={"Idempotency-Key": "k"})
    assert_misconfigured(answer, "configuration-error")
    assert orders == [] and key_row(db, name) is None
    [logged] = [r for r in caplog.records if "scope function" in r.getMessage()]
    assert "user_of" in logged.getMessage() and "SingleStepMiddleware" in logged.getMessage()


def test_a_phased_routes_failing_scope_is_a_clear_configuration_error(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    op = finished_op(f"phased_scope_{uuid.uuid4().hex[:8]}")
    engine.register(op)
    app = phased_app(engine, op, lambda request: request.headers["X-Tenant"])
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/rides", json={"item": "x"}, headers={"Idempotency-Key": "k"})
    assert_misconfigured(answer, "configuration-error")
    assert any("Idempotency.run()" in r.getMessage() for r in caplog.records)


def test_a_scope_functions_http_exception_is_still_the_applications_refusal(
    engine: rp.Engine,
) -> None:
    from fastapi import HTTPException

    def refuse(request: Request) -> str:
        raise HTTPException(401, "sign in first")

    app = app_with(engine, f"refusing_{uuid.uuid4().hex[:8]}", [], scope=refuse)
    with TestClient(app) as client:
        answer = client.post("/orders", json={"item": "x"}, headers={"Idempotency-Key": "k"})
    assert answer.status_code == 401 and answer.json()["detail"] == "sign in first"


def test_a_flask_scope_function_that_fails_is_a_clear_configuration_error(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    import flask

    from recoverypoint.integrations import flask as rp_flask

    def user_of(request: flask.Request) -> str:
        return str(flask.g.user_id)  # never set: the service's mistake

    def refuse(request: flask.Request) -> str:
        flask.abort(401)

    op = finished_op(f"flask_scope_{uuid.uuid4().hex[:8]}")
    engine.register(op)
    app = flask.Flask("scope_tests")
    app.config["PROPAGATE_EXCEPTIONS"] = False
    failing, refusing = (rp_flask.Idempotency(engine, scope=f) for f in (user_of, refuse))
    ran: list[str] = []

    @app.post("/phased")
    def phased() -> flask.Response:
        return failing.run(op, {})

    @app.post("/single")
    @failing.single_step(f"flask_single_{uuid.uuid4().hex[:8]}")
    def single() -> dict[str, str]:
        ran.append("single")
        return {"ok": "yes"}

    @app.post("/refused")
    def refused() -> flask.Response:
        return refusing.run(op, {})

    client = app.test_client()
    for path in ("/phased", "/single"):
        answer = client.post(path, json={}, headers={"Idempotency-Key": "k"})
        assert_misconfigured(answer, "configuration-error")
    assert ran == []
    assert any(
        "user_of" in r.getMessage() and "in the view" in r.getMessage() for r in caplog.records
    )
    assert client.post("/refused", json={}, headers={"Idempotency-Key": "k"}).status_code == 401


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_refused(db: sa.Engine) -> None:
    engine = rp.Engine(db, max_params_bytes=64)
    idempotency = rp_fastapi.Idempotency(engine, scope=lambda request: "tenant")
    app, ran = FastAPI(), []
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.post("/orders")
    @idempotency.single_step(f"limit_{uuid.uuid4().hex[:8]}")
    def place(order: Order) -> dict[str, str]:
        ran.append(order.item)
        return {"item": order.item}

    def body(size: int) -> bytes:
        # Padded with spaces: the body's size is what is checked as it arrives, its
        # canonical JSON (a few bytes) what the params limit sees after.
        return b'{"item": "x"' + b" " * (size - 13) + b"}"

    with TestClient(app) as client:
        headers = {"Idempotency-Key": "k1", "Content-Type": "application/json"}
        at_limit = client.post("/orders", content=body(64), headers=headers)
        headers = {"Idempotency-Key": "k2", "Content-Type": "application/json"}
        over = client.post("/orders", content=body(65), headers=headers)
    assert at_limit.status_code == 200, at_limit.text
    assert over.status_code == 413
    assert len(ran) == 1
