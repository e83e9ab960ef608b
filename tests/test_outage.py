"""A database that goes away reaches callers as rp.DatabaseUnavailable (503 over HTTP, with
Retry-After), never as a driver's exception; the request resumes when the database is back,
its effect made once; and the pool reconnects instead of handing out, one request at a
time, every connection the outage broke. Against a real PostgreSQL: the database refuses
connections (ALLOW_CONNECTIONS false) and its backends are killed (pg_terminate_backend);
the failover suite (test_failover.py) does the same with a real standby and PgBouncer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from fastapi import FastAPI, Request, Response
from http_servers import serve_asgi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outages import database_down, terminate
from rides import Provider, count
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.outage import is_outage, unavailable

APPLICATION = "recoverypoint-outage-tests"


def rides(provider: Provider, before_finish: Any = None, **options: Any) -> rp.Operation[Any]:
    """create ride → charge at the provider → (a hook) → record the charge, 201."""
    op: rp.Operation[Any] = rp.Operation("outage-rides", **options)

    @op.atomic_phase("ride_created")
    def create_ride(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.execute(
            "INSERT INTO rides (key_id, scope) VALUES (%s, %s)", (tx.key_id, params["scope"])
        )

    @op.foreign_step("charge_created")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        charge_id = provider.charge(step.downstream_key(), params["scope"], 2000)
        if before_finish is not None:
            before_finish()
        return {"charge_id": charge_id}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.execute(
            "UPDATE rides SET charge_id = %s WHERE key_id = %s", (tx.state["charge_id"], tx.key_id)
        )
        return rp.Response(201, {"charge_id": tx.state["charge_id"]})

    return op


def async_rides(provider: Provider) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("outage-rides-async")

    @op.foreign_step("charge_created")
    async def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        key = step.downstream_key()
        return {"charge_id": await asyncio.to_thread(provider.charge, key, params["scope"], 1)}

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> rp.Response:
        return rp.Response(201, {"charge_id": tx.state["charge_id"]})

    return op


@pytest.fixture
def outage_db(worker_database_url: str) -> Iterator[sa.Engine]:
    from rides import SCHEMA

    db = create_engine(worker_database_url, poolclass=NullPool)
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    yield db
    db.dispose()


@pytest.fixture
def sync_engine(worker_database_url: str, outage_db: sa.Engine) -> Iterator[rp.Engine]:
    db = create_engine(
        worker_database_url, pool_size=4, connect_args={"application_name": APPLICATION}
    )
    yield rp.Engine(db)
    db.dispose()


def test_every_caller_gets_database_unavailable_while_the_database_is_down(
    server_url: str,
    worker_database_url: str,
    sync_engine: rp.Engine,
    outage_db: sa.Engine,
) -> None:
    provider = Provider(outage_db)
    op = rides(provider)
    sync_engine.register(op)
    calls: list[str] = []

    @rp.idempotent(sync_engine, key="order_id", name="outage-order")
    def place(order_id: str) -> str:
        calls.append(order_id)
        return order_id

    async_engine = rp.AsyncEngine(worker_database_url)
    async_op = async_rides(provider)
    async_engine.register(async_op)
    assert sync_engine.run(op, key="warm", params={"scope": "s"}, scope="s").status == 201

    with database_down(server_url, worker_database_url):
        with pytest.raises(rp.DatabaseUnavailable) as refused:
            sync_engine.run(op, key="k", params={"scope": "s"}, scope="s")
        assert refused.value.retry_after >= 1 and "retry" in str(refused.value)
        with pytest.raises(rp.DatabaseUnavailable):
            asyncio.run(async_engine.run(async_op, key="k", params={"scope": "a"}, scope="a"))
        with pytest.raises(rp.DatabaseUnavailable):
            place("o-1")
        with pytest.raises(rp.DatabaseUnavailable):
            sync_engine.resume(1)
    assert calls == []  # nothing ran while the database was away

    # Back: the same keys finish, each effect made once.
    assert sync_engine.run(op, key="k", params={"scope": "s"}, scope="s").status == 201
    outcome = asyncio.run(async_engine.run(async_op, key="k", params={"scope": "a"}, scope="a"))
    assert outcome.status == 201
    assert place("o-1") == "o-1" and calls == ["o-1"]
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = 's'") == 2
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = 'a'") == 1
    asyncio.run(async_engine.dispose())


def test_bad_params_while_the_database_is_down_are_still_the_callers_to_fix(
    server_url: str,
    worker_database_url: str,
    sync_engine: rp.Engine,
    outage_db: sa.Engine,
) -> None:
    # The async engine checks a request's params while its lookup is on its way; a lookup
    # that cannot go out must not make bad input look like an outage, which a client
    # would retry: params it must fix are InvalidParams on both engines, database or not.
    provider = Provider(outage_db)
    op = rides(provider)
    sync_engine.register(op)
    async_engine = rp.AsyncEngine(worker_database_url)
    async_op = async_rides(provider)
    async_engine.register(async_op)
    assert sync_engine.run(op, key="warm", params={"scope": "s"}, scope="s").status == 201
    warm = asyncio.run(async_engine.run(async_op, key="warm", params={"scope": "a"}, scope="a"))
    assert warm.status == 201
    bad = {"scope": float("nan")}
    try:
        with database_down(server_url, worker_database_url):
            # On the pool's connection, which the outage killed; then with none left to
            # borrow, the pool's connect refused before any lookup could go out.
            for _ in range(2):
                with pytest.raises(rp.InvalidParams):
                    sync_engine.run(op, key="k", params=bad, scope="s")
                sync_engine.db.dispose()
            for _ in range(2):
                with pytest.raises(rp.InvalidParams):
                    asyncio.run(async_engine.run(async_op, key="k", params=bad, scope="a"))
                asyncio.run(async_engine.async_db.dispose())
            # Good params are told to retry, as before.
            with pytest.raises(rp.DatabaseUnavailable):
                asyncio.run(async_engine.run(async_op, key="k", params={"scope": "a"}, scope="a"))
    finally:
        asyncio.run(async_engine.dispose())
    assert count(outage_db, "SELECT count(*) FROM provider_charges") == 2  # the warm-ups


def test_a_connection_killed_mid_request_is_database_unavailable_and_the_retry_charges_once(
    worker_database_url: str, sync_engine: rp.Engine, outage_db: sa.Engine
) -> None:
    # The foreign step's call is made; then every backend of the engine is killed, so the
    # phase that records the charge finds its pooled connection dead.
    def kill() -> None:
        with outage_db.connect() as conn:
            assert terminate(conn, sa.make_url(worker_database_url).database) >= 1

    provider = Provider(outage_db)
    op = rides(provider, before_finish=kill)
    sync_engine.register(op)
    # Two pooled connections, both idle while the step runs: both die.
    with sync_engine.db.connect(), sync_engine.db.connect():
        pass
    with pytest.raises(rp.DatabaseUnavailable) as refused:
        sync_engine.run(op, key="k", params={"scope": "m"}, scope="m")
    assert isinstance(refused.value.__cause__, Exception) and is_outage(refused.value.__cause__)
    # The lease was given up on a new connection, not on another dead one from the pool.
    op_again = rides(provider)
    engine = rp.Engine(sync_engine.db)
    engine.register(op_again)
    outcome = engine.run(op_again, key="k", params={"scope": "m"}, scope="m")
    assert outcome.status == 201 and not outcome.replayed
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = 'm'") == 1
    assert len(set(provider.keys_seen)) == 1


@pytest.mark.slow
def test_a_step_that_cannot_be_recorded_in_an_outage_is_one_warning_and_runs_again_once(
    server_url: str,
    worker_database_url: str,
    sync_engine: rp.Engine,
    outage_db: sa.Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The database goes away after the provider charged: the phase after the step fails,
    # and so does recording the step's result on its own. The operator gets one warning
    # that says why, not an error with a traceback per request; the retry, once the
    # database is back, hands the provider the same downstream key.
    down = ExitStack()

    def go_down() -> None:
        down.enter_context(database_down(server_url, worker_database_url))

    provider = Provider(outage_db)
    # A short lease: the failed request could not give its lease up either.
    lease = timedelta(seconds=1)
    op = rides(provider, before_finish=go_down, lock_timeout=lease)
    sync_engine.register(op)
    caplog.set_level(logging.INFO, logger="recoverypoint")
    with down, pytest.raises(rp.DatabaseUnavailable):
        sync_engine.run(op, key="k", params={"scope": "r"}, scope="r")
    recorded = [r for r in caplog.records if "could not record foreign step" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in recorded] == [(logging.WARNING, None)]
    assert "the database is away" in recorded[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    op_again = rides(provider, lock_timeout=lease)
    engine = rp.Engine(sync_engine.db)
    engine.register(op_again)
    for _ in range(10):  # KeyInUse until the lease it could not release runs out
        try:
            outcome = engine.run(op_again, key="k", params={"scope": "r"}, scope="r")
            break
        except rp.KeyInUse as busy:
            time.sleep(busy.retry_after)  # as a client honouring Retry-After does
    assert outcome.status == 201 and not outcome.replayed
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = 'r'") == 1
    assert len(set(provider.keys_seen)) == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_after_an_outage_the_pool_reconnects_instead_of_handing_out_dead_connections(
    worker_database_url: str, outage_db: sa.Engine, kind: str
) -> None:
    # Four idle pooled connections, all killed: the first request finds one dead and
    # fails; the pool then reconnects the other three on their next checkout, so the next
    # request succeeds instead of failing three times more.
    provider = Provider(outage_db)
    database = sa.make_url(worker_database_url).database

    def killed() -> None:
        with outage_db.connect() as conn:
            assert terminate(conn, database) == 4

    if kind == "sync":
        db = create_engine(worker_database_url, pool_size=4, max_overflow=0)
        engine = rp.Engine(db)
        op = rides(provider)
        engine.register(op)
        held = [db.raw_connection() for _ in range(4)]
        for pooled in held:
            pooled.close()  # back to the pool, idle
        killed()
        with pytest.raises(rp.DatabaseUnavailable):
            engine.run(op, key="k1", params={"scope": kind}, scope=kind)
        assert engine.run(op, key="k2", params={"scope": kind}, scope=kind).status == 201
        assert engine.run(op, key="k1", params={"scope": kind}, scope=kind).status == 201
        db.dispose()
        return

    async def scenario() -> None:
        async_db = sa_async.create_async_engine(
            normalize_url(worker_database_url), pool_size=4, max_overflow=0
        )
        engine = rp.AsyncEngine(async_db)
        op = async_rides(provider)
        engine.register(op)
        connections = [await async_db.connect() for _ in range(4)]
        for connection in connections:
            await connection.close()
        await asyncio.to_thread(killed)
        with pytest.raises(rp.DatabaseUnavailable):
            await engine.run(op, key="k1", params={"scope": kind}, scope=kind)
        assert (await engine.run(op, key="k2", params={"scope": kind}, scope=kind)).status == 201
        assert (await engine.run(op, key="k1", params={"scope": kind}, scope=kind)).status == 201
        await async_db.dispose()

    asyncio.run(scenario())
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=kind) == 2


def test_over_http_an_outage_is_a_503_problem_with_retry_after_and_no_detail(
    server_url: str, worker_database_url: str, sync_engine: rp.Engine, outage_db: sa.Engine
) -> None:
    provider = Provider(outage_db)
    op = rides(provider)
    sync_engine.register(op)
    idempotency = rp_fastapi.Idempotency(sync_engine, scope=lambda request: "tenant")
    app = FastAPI()

    @app.post("/rides")
    def post_ride(request: Request, body: dict[str, str]) -> Response:
        return idempotency.run(op, request, body)

    headers = {"Idempotency-Key": "h-1"}
    with serve_asgi(app) as url, httpx.Client(base_url=url) as client:
        with database_down(server_url, worker_database_url):
            refused = client.post("/rides", json={"scope": "h"}, headers=headers)
        done = client.post("/rides", json={"scope": "h"}, headers=headers)
    assert refused.status_code == 503, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert int(refused.headers["retry-after"]) >= 1
    problem = refused.json()
    assert problem["type"].endswith(":database-unavailable")
    assert "retry" in problem["detail"] and "psycopg" not in refused.text
    assert "SQLSTATE" not in refused.text and "Traceback" not in refused.text
    assert done.status_code == 201
    assert count(outage_db, "SELECT count(*) FROM provider_charges WHERE scope = 'h'") == 1


# Errors of the driver as it raises them, with and without SQLAlchemy around them.
_OUTAGES = [
    psycopg.OperationalError("connection failed: Connection refused"),
    psycopg.InterfaceError("the connection is closed"),
    psycopg.DatabaseError("consuming input failed: server closed the connection"),
]
_NOT_OUTAGES = [
    psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
    psycopg.ProgrammingError("query has no results"),
    ValueError("bad"),
]


@pytest.mark.parametrize("error", _OUTAGES, ids=repr)
def test_client_side_connection_errors_are_outages(error: Exception) -> None:
    assert is_outage(error)
    wrapped = sa.exc.OperationalError("SELECT 1", {}, error)
    assert is_outage(wrapped) and "retry" in str(unavailable(wrapped))


@pytest.mark.parametrize("error", _NOT_OUTAGES, ids=repr)
def test_the_request_own_errors_are_not_outages(error: Exception) -> None:
    assert not is_outage(error)


_STATES = st.one_of(
    st.sampled_from(
        ["57P01", "57P02", "57P03", "57P04", "57P05", "57014", "25006", "25P02", "08006",
         "08P01", "53300", "53100", "58030", "55P03", "54000", "40001", "40P01", "23505",
         "42P05", "26000", "XX000", "RP001", "58000", "58P01"]
    ),
    st.text(alphabet="0123456789ABCDEFPXZ", min_size=5, max_size=5),
)  # fmt: skip


@given(state=_STATES)
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_an_error_is_an_outage_by_its_sqlstate_class_alone(state: str) -> None:
    # Connection (08), resources (53), system (58000, 58030), the shutdowns (57P0x), a read-only
    # server (25006) are the database's failures; serialization failures, timeouts, and
    # every error of the request's own SQL are not.
    error = psycopg.errors.lookup(state) if _known(state) else psycopg.DatabaseError
    exc = error("x")
    exc.sqlstate = state  # type: ignore[misc]  # what the server would have sent
    # Written as a table, not as the module's rule: 58P01 (a file a statement names) is the
    # statement's, 58000 and 58030 the server's.
    expected = state[:2] in ("08", "53") or state in (
        "57P01",
        "57P02",
        "57P03",
        "57P05",
        "25006",
        "58000",
        "58030",
    )
    assert is_outage(exc) == expected


def _known(state: str) -> bool:
    try:
        psycopg.errors.lookup(state)
    except KeyError:
        return False
    return True
