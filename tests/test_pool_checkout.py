"""The async engine's checkout of a pooled connection (recoverypoint.engine._pg_async): an idle
connection that SQLAlchemy's pool would hand out as it is comes out without the pool's
greenlet; one it would connect, ping, recycle or tell a listener of still goes through it,
and every borrower gets a connection that works, whatever happened to the pool before.

Each case of the second kind fails with SQLAlchemy's ``MissingGreenlet`` if the look before
the quick checkout misses it. So does a pool at its limit on a SQLAlchemy whose queue awaits
even a connection it holds (2.0, 2.1.1): those go through the greenlet there.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.util import greenlet_spawn

from recoverypoint.database import normalize_url
from recoverypoint.engine import _pg_async

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


@contextlib.asynccontextmanager
async def pool_of(database_url: str, **options: Any) -> AsyncIterator[sa_async.AsyncEngine]:
    db = sa_async.create_async_engine(normalize_url(database_url), **options)
    try:
        yield db
    finally:
        await db.dispose()


async def backend(db: sa_async.AsyncEngine) -> int:
    """The server process of the connection a request would borrow now: it answers."""
    pooled, connection, switched = await _pg_async._borrow(db, autocommit=True)
    try:
        cursor = await connection.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        pid: int = row[0]
        return pid
    finally:
        await _pg_async._give_back(db, pooled, connection, switched)


def terminate(db: sa.Engine, pid: int) -> None:
    """End server process ``pid``, and wait until it is gone."""
    with db.connect() as other:
        ended = other.execute(sa.text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid})
        assert ended.scalar() is True
        other.commit()


async def hold(db: sa_async.AsyncEngine) -> tuple[Any, psycopg.AsyncConnection[Any], bool]:
    return await _pg_async._borrow(db, autocommit=False)


def through_greenlet(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count the checkouts that go through SQLAlchemy's greenlet from now on."""
    counted = 0
    raw_connection = sa_async.AsyncEngine.raw_connection

    async def counting(self: Any) -> Any:
        nonlocal counted
        counted += 1
        return await raw_connection(self)

    monkeypatch.setattr(sa_async.AsyncEngine, "raw_connection", counting)
    return lambda: counted


# Below the pool's limit (room to connect more), and at it (every connection it may make
# made): at its limit SQLAlchemy asks its queue to wait for a connection.
@pytest.mark.parametrize("max_overflow", [5, 0], ids=["below its limit", "at its limit"])
async def test_an_idle_connection_comes_out_without_the_greenlet(
    database_url: str, monkeypatch: pytest.MonkeyPatch, max_overflow: int
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=max_overflow) as db:
        first = await backend(db)  # the pool connects it: through the greenlet
        counted = through_greenlet(monkeypatch)
        assert [await backend(db) for _ in range(3)] == [first] * 3
        at_once = max_overflow > 0 or _pg_async._QUEUE_HANDS_OUT_AT_ONCE
        assert counted() == (0 if at_once else 3)
        assert db.sync_engine.pool.checkedout() == 0


async def test_the_queue_is_asked_as_the_installed_sqlalchemy_answers(database_url: str) -> None:
    """The probe of SQLAlchemy's queue says what a pool at its limit does outside the
    greenlet: 2.1.9 hands out its idle connection at once; 2.0 and 2.1.1 await their queue,
    which raises ``MissingGreenlet`` there (without a timeout, as nothing is left behind)."""
    async with pool_of(database_url, pool_size=1, max_overflow=0, pool_timeout=None) as db:
        await backend(db)  # its one connection made, and idle
        try:
            pooled = db.pool.connect()
        except sa.exc.MissingGreenlet:
            handed_out = False
        else:
            handed_out = True
            await greenlet_spawn(pooled.close)
        assert _pg_async._QUEUE_HANDS_OUT_AT_ONCE is handed_out


@pytest.mark.parametrize("soft", [False, True])
async def test_a_connection_invalidated_in_the_pool_is_replaced(
    database_url: str, soft: bool
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0) as db:
        pooled, connection, switched = await hold(db)
        first = connection.info.backend_pid
        # Invalidated while checked out, then handed back with its connection open: soft
        # marks the record for a reconnect at its next checkout; hard closes it now.
        if soft:
            pooled.invalidate(soft=True)
            await _pg_async._give_back(db, pooled, connection, switched)
        else:
            await greenlet_spawn(pooled.invalidate)
            await _pg_async._give_back(db, pooled, connection, switched)
        assert await backend(db) != first


async def test_after_an_outage_every_older_connection_is_replaced(database_url: str) -> None:
    """What the engine does when a connection broke (a failover): the pool reconnects
    every connection made before it."""
    async with pool_of(database_url, pool_size=2, max_overflow=0) as db:
        held = [await hold(db) for _ in range(2)]
        before = {connection.info.backend_pid for _, connection, _ in held}
        for pooled, connection, switched in held:
            await _pg_async._give_back(db, pooled, connection, switched)
        await greenlet_spawn(_pg_async.drop_older_connections, db.sync_engine.pool, held[0][0])
        assert await backend(db) not in before


async def test_a_connection_due_for_recycling_is_recycled(database_url: str) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0, pool_recycle=3600) as db:
        first = await backend(db)
        assert await backend(db) == first  # young: handed out as it is
        pooled, connection, switched = await hold(db)
        pooled._connection_record.starttime -= 3600  # an hour old, as the pool sees it
        await _pg_async._give_back(db, pooled, connection, switched)
        assert await backend(db) != first


async def test_a_connection_within_a_second_of_recycling_goes_through_the_greenlet(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock moves on between the look and the pool's own: a connection about to be
    recycled is left to the pool's greenlet, where closing it may wait."""
    async with pool_of(database_url, pool_size=1, max_overflow=0, pool_recycle=3600) as db:
        pooled, connection, switched = await hold(db)
        pooled._connection_record.starttime -= 3599.01
        await _pg_async._give_back(db, pooled, connection, switched)
        counted = through_greenlet(monkeypatch)
        await backend(db)
        assert counted() == 1


async def test_a_connection_more_than_a_second_from_recycling_comes_out_at_once(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=5, pool_recycle=3600) as db:
        pooled, connection, switched = await hold(db)
        first = connection.info.backend_pid
        pooled._connection_record.starttime -= 3598
        await _pg_async._give_back(db, pooled, connection, switched)
        counted = through_greenlet(monkeypatch)
        assert await backend(db) == first
        assert counted() == 0


async def test_a_pinged_pool_finds_a_connection_the_server_ended(
    database_url: str, db: sa.Engine
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0, pool_pre_ping=True) as adb:
        first = await backend(adb)
        terminate(db, first)
        assert await backend(adb) != first


async def test_a_checkout_listener_runs_its_statements_at_every_checkout(
    database_url: str,
) -> None:
    """A listener that sends a statement (a per-checkout ``SET``, say) waits for the
    server, which only the pool's greenlet can."""
    async with pool_of(database_url, pool_size=1, max_overflow=0) as db:
        checkouts = 0

        def named(dbapi_connection: Any, *_: Any) -> None:
            nonlocal checkouts
            checkouts += 1
            cursor = dbapi_connection.cursor()
            cursor.execute(f"SET application_name = 'checkout {checkouts}'")
            cursor.close()
            dbapi_connection.commit()

        sa.event.listen(db.sync_engine.pool, "checkout", named)
        for expected in range(1, 4):
            pooled, connection, switched = await hold(db)
            try:
                assert connection.info.parameter_status("application_name") == (
                    f"checkout {expected}"
                )
            finally:
                await _pg_async._give_back(db, pooled, connection, switched)


@pytest.mark.parametrize("lifo", [True, False], ids=["last in, first out", "first in, first out"])
async def test_the_connection_looked_at_is_the_one_handed_out(
    database_url: str, lifo: bool
) -> None:
    """The pool hands out the last connection checked in with ``pool_use_lifo``, else the
    first: the one invalidated here, which the look must see, not the other end of the
    queue."""
    async with pool_of(database_url, pool_size=2, max_overflow=5, pool_use_lifo=lifo) as db:
        first, second = await hold(db), await hold(db)
        invalidated, kept = (second, first) if lifo else (first, second)
        pid = invalidated[1].info.backend_pid
        invalidated[0].invalidate(soft=True)
        await _pg_async._give_back(db, *first)
        await _pg_async._give_back(db, *second)
        assert await backend(db) != pid
        assert kept[1].info.backend_pid != pid


async def test_a_pool_of_a_class_derived_from_the_queue_pool_checks_out_in_the_greenlet(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subclass may hand out connections its own way: only the look at the queue pool
    itself knows what it does."""

    class Derived(sa.pool.AsyncAdaptedQueuePool):
        pass

    async with pool_of(database_url, poolclass=Derived, pool_size=1, max_overflow=5) as db:
        first = await backend(db)
        counted = through_greenlet(monkeypatch)
        assert await backend(db) == first
        assert counted() == 1


async def test_a_pool_with_none_idle_connects_another(database_url: str) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=1) as db:
        held = await hold(db)
        assert await backend(db) != held[1].info.backend_pid
        await _pg_async._give_back(db, *held)


async def test_a_pool_of_its_own_kind_checks_out_as_before(database_url: str) -> None:
    async with pool_of(database_url, poolclass=sa.pool.NullPool) as db:
        assert await backend(db) != await backend(db)


# What may happen to a pooled connection between two checkouts.
EVENTS = st.sampled_from(["borrow", "invalidate", "soften", "age", "end", "outage", "hold"])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_every_checkout_works_whatever_happened_before(
    database_url: str, db: sa.Engine, loop: str
) -> None:
    """Each example on a loop of its own, so that hypothesis can shrink a failing one."""
    if loop == "uvloop":
        new_loop: Callable[[], asyncio.AbstractEventLoop] = pytest.importorskip(
            "uvloop"
        ).new_event_loop
    else:
        new_loop = asyncio.new_event_loop

    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        st.lists(EVENTS, min_size=1, max_size=12),
        st.booleans(),
        st.sampled_from([0, 1]),  # at the pool's limit once every connection is made, or not
    )
    def checkouts(events: list[str], lifo: bool, max_overflow: int) -> None:
        loop = new_loop()  # asyncio.Runner is 3.11's
        try:
            loop.run_until_complete(play(database_url, db, events, lifo, max_overflow))
        finally:
            loop.close()

    checkouts()


async def play(
    database_url: str, db: sa.Engine, events: list[str], lifo: bool, max_overflow: int
) -> None:
    async with pool_of(
        database_url,
        pool_size=2,
        max_overflow=max_overflow,
        pool_recycle=3600,
        pool_use_lifo=lifo,
    ) as adb:
        held: list[tuple[Any, psycopg.AsyncConnection[Any], bool]] = []
        for event in events:
            if event == "hold" and len(held) < 1 + max_overflow:  # one left to borrow
                held.append(await hold(adb))
                continue
            pooled, connection, switched = await hold(adb)
            if event == "invalidate":
                await greenlet_spawn(pooled.invalidate)
            elif event == "soften":
                pooled.invalidate(soft=True)
            elif event == "age":
                pooled._connection_record.starttime -= 3600
            elif event == "end":  # the server ends it; the next statement finds out
                terminate(db, connection.info.backend_pid)
                with pytest.raises(psycopg.OperationalError):
                    await connection.execute("SELECT 1")
            elif event == "outage":
                await greenlet_spawn(_pg_async.drop_older_connections, adb.sync_engine.pool, pooled)
            await _pg_async._give_back(adb, pooled, connection, switched)
            assert await backend(adb) > 0
        for pooled, connection, switched in held:
            await _pg_async._give_back(adb, pooled, connection, switched)
        assert adb.sync_engine.pool.checkedout() == 0


class _CollectingClock:
    """``time`` for the look: runs the garbage collector as the look reads the clock, as it
    may run at any allocation between the look and the checkout."""

    def __init__(self) -> None:
        self.collected = 0

    def time(self) -> float:
        self.collected += gc.collect()
        return time.time()


# SQLAlchemy warns of the connection it finalizes for nobody having closed it, and leaves
# the connecting coroutine it could not await outside the greenlet unawaited.
@pytest.mark.filterwarnings(
    "ignore::ResourceWarning",
    "ignore::sqlalchemy.exc.SAWarning",
    "ignore:coroutine 'AsyncConnection.connect' was never awaited:RuntimeWarning",
)
async def test_a_connection_collected_between_the_look_and_the_checkout_is_connected_again(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection nobody closed, in a reference cycle, finalized by the collector after
    the look: its record goes back into the queue without a connection, last, where a
    last-in-first-out pool takes it from. The borrow gets a connection that works."""
    async with pool_of(
        database_url, pool_size=2, max_overflow=5, pool_use_lifo=True, pool_recycle=3600
    ) as db:
        idle = await db.raw_connection()
        leaked = await db.raw_connection()
        pid = leaked.driver_connection.info.backend_pid
        await greenlet_spawn(idle.close)
        cycle: list[Any] = [leaked]
        cycle.append(cycle)
        del leaked, cycle
        clock = _CollectingClock()
        monkeypatch.setattr(_pg_async, "time", clock)
        gc.disable()  # the collection comes where the clock is read, not before
        try:
            found = await backend(db)
        finally:
            gc.enable()
        assert clock.collected > 0
        assert found not in (pid, 0)
        gc.collect()  # that coroutine, while its warning is ignored
