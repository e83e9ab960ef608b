"""The async engine's statements on libpq (recoverypoint.engine._libpq_async), waited for on
the event loop: values of any shape reach the server intact, a statement is prepared once
per connection in the pipeline that first runs it, and statements that psycopg or the
application deallocated are prepared again, as tests/test_libpq.py says of the sync engine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus
from pydantic import BaseModel
from rides import count
from sqlalchemy.pool import NullPool
from sqlalchemy.util import greenlet_spawn
from test_libpq import ECHO, Traced, stored_text

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.engine import _libpq, _libpq_async
from recoverypoint.keys import MAX_JSON_DEPTH

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """The default loop and uvloop (uvicorn's default when it is installed): the waits on
    libpq assume neither."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


@pytest.fixture
async def async_db(database_url: str, business_tables: None) -> AsyncIterator[Any]:
    """A pool of one connection: every request and every test statement share it."""
    db = sa_async.create_async_engine(normalize_url(database_url), pool_size=1, max_overflow=0)
    yield db
    await db.dispose()


@pytest.fixture
async def one_connection(async_db: Any) -> AsyncIterator[rp.AsyncEngine]:
    engine = rp.AsyncEngine(async_db)
    yield engine
    await engine.dispose()


def _echo_params() -> dict[str, Any]:
    return {"s": "s", "a": [], "i": 1, "f": 1.0, "u": uuid.uuid4(), "n": None}


async def test_values_reach_the_server_as_they_were(async_db: Any) -> None:
    pooled = await async_db.raw_connection()
    connection = pooled.driver_connection
    await connection.set_autocommit(True)
    seen: list[tuple[Any, ...]] = []

    # hypothesis drives sync functions: the examples are drawn first, then sent.
    @settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        text=stored_text,
        items=st.lists(st.one_of(st.none(), stored_text), max_size=5),
        number=st.integers(-(2**63), 2**63 - 1),
        real=st.floats(allow_nan=False, allow_infinity=False),
    )
    def draw(text: str, items: list[str | None], number: int, real: float) -> None:
        seen.append((text, items, number, real))

    draw()
    try:
        for index, (text, items, number, real) in enumerate(seen):
            token = uuid.uuid4()
            params = {"s": text, "a": items, "i": number, "f": real, "u": token, "n": None}
            # Alone, after BEGIN, and between BEGIN and COMMIT: each pipeline shape.
            begin, commit = (str(index) if index % 3 > 0 else None), index % 3 == 2
            row = await _libpq_async.execute(
                pooled, connection, ECHO, params, begin=begin, commit=commit
            )
            if begin is not None and not commit:
                await _libpq_async.command(connection, b"COMMIT")
            assert row is not None
            assert row[0] == text
            assert json.loads(row[1] or "null") == items
            assert int(row[2] or "") == number
            assert float(row[3] or "") == real
            assert row[4] == str(token)
            assert row[5] == "t"
    finally:
        await connection.set_autocommit(False)
        await greenlet_spawn(pooled.close)


async def test_a_statement_is_prepared_once_per_connection(
    one_connection: rp.AsyncEngine, scope: str
) -> None:
    engine = one_connection
    op = _ride(scope)
    engine.register(op)
    assert (await engine.run(op, key="a", params={}, scope=scope)).status == 201
    async with engine.async_db.connect() as conn:
        pooled = await conn.get_raw_connection()
        names = set(pooled.info.get(_libpq.PREPARED, ()))
        held = await conn.exec_driver_sql(
            "SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'recoverypoint_')"
        )
        on_server = {row[0].encode() for row in held}
        await conn.rollback()
    if _libpq.CLOSES:
        assert names and names <= on_server
    else:  # a libpq before 17 cannot send a Close: the statements go unnamed
        assert not names and not on_server
    # A second request prepares nothing more and sends what is prepared.
    assert (await engine.run(op, key="b", params={}, scope=scope)).status == 201
    async with engine.async_db.connect() as conn:
        pooled = await conn.get_raw_connection()
        assert set(pooled.info.get(_libpq.PREPARED, ())) == names
        await conn.rollback()


async def test_a_statement_someone_deallocated_is_prepared_again(async_db: Any) -> None:
    pooled = await async_db.raw_connection()
    connection = pooled.driver_connection
    await connection.set_autocommit(True)
    try:
        assert await _libpq_async.execute(pooled, connection, ECHO, _echo_params())
        await connection.execute("DEALLOCATE ALL")
        assert await _libpq_async.execute(pooled, connection, ECHO, _echo_params())
        await connection.execute("DISCARD ALL")
        row = await _libpq_async.execute(pooled, connection, ECHO, _echo_params(), begin="1")
        assert row is not None
        await connection.rollback()
    finally:
        await connection.set_autocommit(False)
        await greenlet_spawn(pooled.close)


async def test_requests_go_on_after_the_application_deallocates_between_them(
    one_connection: rp.AsyncEngine, db: sa.Engine, scope: str
) -> None:
    """psycopg deallocates every prepared statement after a ROLLBACK it sends, once it
    prepared one of its own: an application's rolled-back transaction on the pool's
    connection takes the engine's statements with it."""
    engine = one_connection
    op = _ride(scope)
    engine.register(op)
    assert (await engine.run(op, key="a", params={}, scope=scope)).status == 201
    for _ in range(6):  # psycopg prepares a statement on its 5th run
        async with engine.async_db.connect() as conn:
            await conn.execute(sa.text("SELECT 1 WHERE 1 = :one"), {"one": 1})
            await conn.rollback()
    assert (await engine.run(op, key="b", params={}, scope=scope)).status == 201
    async with engine.async_db.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.exec_driver_sql("DISCARD ALL")
    assert (await engine.run(op, key="a", params={}, scope=scope)).replayed
    assert (await engine.run(op, key="c", params={}, scope=scope)).status == 201
    audits = "SELECT count(*) FROM audit_records WHERE scope = :s AND action = :a"
    assert count(db, audits, s=scope, a="created") == 3  # a, b and c: once each


async def test_a_phase_that_rolls_back_to_a_savepoint_commits(
    one_connection: rp.AsyncEngine, scope: str
) -> None:
    """Inside a phase: once psycopg prepared a statement, ROLLBACK TO SAVEPOINT makes it
    deallocate them all, and the engine prepares its own again before recording the phase."""
    engine = one_connection
    op: rp.Operation[Any] = rp.Operation(f"savepoint_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    async def undo_a_part(tx: Any, params: Any) -> rp.Response:
        for _ in range(6):  # psycopg prepares a statement on its 5th run
            await tx.execute("SELECT 1 WHERE 1 = %s", (1,))
        if params["undo"]:
            await tx.execute("SAVEPOINT part")
            await tx.execute("ROLLBACK TO SAVEPOINT part")
        return rp.Response(201)

    engine.register(op)
    # The first prepares the engine's statements on the pool's one connection.
    assert (await engine.run(op, key="warm", params={"undo": False}, scope=scope)).status == 201
    for key in ("a", "b"):
        outcome = await engine.run(op, key=key, params={"undo": True}, scope=scope)
        assert outcome.status == 201


def _ride(scope: str) -> rp.Operation[Any]:
    """One phase that writes an audit record and answers."""
    op: rp.Operation[Any] = rp.Operation(f"libpq_async_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    async def create(tx: Any, params: Any) -> rp.Response:
        await tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'created', %s)",
            (scope, tx.key_id),
        )
        return rp.Response(201)

    return op


@pytest.mark.parametrize("isolation_level", [None, "AUTOCOMMIT"])
async def test_the_pooler_check_is_one_query_on_the_async_engine_too(
    database_url: str, isolation_level: str | None
) -> None:
    # As tests/test_libpq.py's sync case: one round trip through SQLAlchemy's adapter, and
    # the connection handed out in the engine's mode.
    options = {"isolation_level": isolation_level} if isolation_level else {}
    db = sa_async.create_async_engine(normalize_url(database_url), poolclass=NullPool, **options)
    engine = rp.AsyncEngine(db)
    try:
        async with db.connect():  # the first connection: the dialect asks the server its settings
            pass
        with Traced(db.sync_engine) as traced:
            async with db.connect() as conn:
                driver = (await conn.get_raw_connection()).driver_connection
                assert traced.sent(driver) == ['Query "SELECT pg_backend_pid()"']
                assert driver.autocommit is (isolation_level == "AUTOCOMMIT")
    finally:
        await engine.dispose()
        await db.dispose()


class _Counted(BaseModel):
    n: int


async def test_the_params_are_checked_while_the_lookup_is_on_its_way(
    async_db: Any, scope: str
) -> None:
    # A request's lookup goes out first, and its params are validated and fingerprinted
    # while the server answers, where the client would only wait. The first lookup on a
    # connection prepares its statement in a pipeline: there the params are checked first.
    # The pool has its connection idle: a borrow that might wait checks them first too.
    pooled = await async_db.raw_connection()
    connection = pooled.driver_connection  # the pool's one connection, every request's
    await greenlet_spawn(pooled.close)
    op: rp.Operation[Any] = rp.Operation(f"checked_{uuid.uuid4().hex[:8]}", params=_Counted)

    @op.atomic_phase("finished")
    async def finish(tx: Any, params: _Counted) -> rp.Response:
        return rp.Response(201, {"n": params.n})

    seen: list[TransactionStatus] = []
    dump = op.dump_params

    def watched(params: Any) -> str:
        seen.append(connection.pgconn.transaction_status)  # ACTIVE: a statement is out
        return dump(params)

    op.dump_params = watched  # type: ignore[method-assign]
    engine = rp.AsyncEngine(async_db)
    engine.register(op)
    try:
        assert (await engine.run(op, key="a", params={"n": 1}, scope=scope)).status == 201
        assert (await engine.run(op, key="b", params={"n": 2}, scope=scope)).status == 201
        replayed = await engine.run(op, key="b", params={"n": 2}, scope=scope)
    finally:
        await engine.dispose()
    assert replayed.replayed and replayed.body == {"n": 2}
    # With a libpq before 17 the statements go unnamed, never through the pipeline.
    first = TransactionStatus.IDLE if _libpq.CLOSES else TransactionStatus.ACTIVE
    assert seen == [first, TransactionStatus.ACTIVE, TransactionStatus.ACTIVE]


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return {"n": value}


# What a retry or a hostile caller may send on a key: the params it was used with, others,
# or params refused (JSON cannot carry them, PostgreSQL cannot store them, too deep, too
# large).
_sent_params = st.one_of(
    st.just({"n": 1}),
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=4),
    st.sampled_from([{"n": float("nan")}, {"n": float("inf")}]),
    st.text(max_size=10).map(lambda text: {"n": text + "\x00"}),
    st.text(max_size=10).map(lambda text: {"n": text + "\ud800"}),
    st.integers(MAX_JSON_DEPTH + 1, 3 * MAX_JSON_DEPTH).map(_nested),
    st.integers(70_000, 90_000).map(lambda size: {"n": "x" * size}),
)


async def test_refused_params_leave_the_pool_its_connection_and_store_nothing(
    async_db: Any, scope: str
) -> None:
    # Params refused while the lookup is on its way: the lookup's answer is read before
    # the error is raised, so the connection goes back to the pool idle, not dropped.
    connects: list[object] = []
    sa.event.listen(async_db.sync_engine.pool, "connect", lambda *_: connects.append(1))
    engine = rp.AsyncEngine(async_db, max_params_bytes=64 * 1024)
    op = _ride(scope)
    engine.register(op)
    drawn: list[Any] = []

    @settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(params=_sent_params)
    def draw(params: Any) -> None:
        drawn.append(params)

    draw()
    new_keys = 0
    try:
        assert (await engine.run(op, key="done", params={"n": 1}, scope=scope)).status == 201
        for index, params in enumerate(drawn):
            for key in ("done", f"new-{index}"):  # a finished key, and a new one
                try:
                    outcome = await engine.run(op, key=key, params=params, scope=scope)
                except (rp.InvalidParams, rp.RequestTooLarge):
                    continue
                except rp.ParamsMismatch:
                    assert key == "done" and params != {"n": 1}
                    continue
                assert outcome.status == 201 and outcome.replayed == (key == "done")
                new_keys += key != "done"
        assert (await engine.run(op, key="after", params={}, scope=scope)).status == 201
        async with async_db.connect() as conn:
            stored = await conn.scalar(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE scope = :s"), {"s": scope}
            )
            await conn.rollback()
    finally:
        await engine.dispose()
    assert stored == 2 + new_keys
    assert connects == [1]  # one connection from the first request to the last


async def test_bad_params_are_refused_before_a_borrow_that_would_wait(
    database_url: str, business_tables: None, scope: str
) -> None:
    # With no idle connection in the pool, a borrow waits for one (or makes one): bad
    # params are refused first, not once the pool gives up (a refusal after the borrow
    # was raised while the pool's timeout was handled).
    db = sa_async.create_async_engine(
        normalize_url(database_url), pool_size=1, max_overflow=0, pool_timeout=0.05
    )
    engine = rp.AsyncEngine(db)
    op = _ride(scope)
    engine.register(op)
    try:
        assert (await engine.run(op, key="warm", params={}, scope=scope)).status == 201
        held = await db.raw_connection()  # the pool's one connection
        try:
            with pytest.raises(rp.InvalidParams) as refused:
                await engine.run(op, key="bad", params={"n": float("nan")}, scope=scope)
            raised_in: list[BaseException] = []
            cause: BaseException | None = refused.value
            while cause is not None:
                raised_in.append(cause)
                cause = cause.__context__
            assert not any(isinstance(e, sa.exc.SQLAlchemyError) for e in raised_in)
        finally:
            await greenlet_spawn(held.close)
        # The connection back, good params are served.
        assert (await engine.run(op, key="good", params={}, scope=scope)).status == 201
    finally:
        await engine.dispose()
        await db.dispose()
