"""The async engine's checkout of a pooled connection (recoverypoint.engine._pg_async): an idle
connection that SQLAlchemy's pool would hand out as it is comes out without the pool's
greenlet; one it would connect, ping, recycle or tell a listener of still goes through it,
and every borrower gets a connection that works, whatever happened to the pool before.

Each case of the second kind fails with SQLAlchemy's ``MissingGreenlet`` if the look before
the quick checkout misses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
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


async def test_an_idle_connection_comes_out_without_the_greenlet(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0) as db:
        first = await backend(db)  # the pool connects it: through the greenlet

        async def refused(self: Any) -> None:
            raise AssertionError("an idle connection went through the pool's greenlet")

        monkeypatch.setattr(sa_async.AsyncEngine, "raw_connection", refused)
        assert [await backend(db) for _ in range(3)] == [first] * 3
        assert db.sync_engine.pool.checkedout() == 0


async def test_an_invalidated_connection_is_replaced(database_url: str) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0) as db:
        first = await backend(db)
        pooled, connection, switched = await hold(db)
        await greenlet_spawn(pooled.invalidate)
        await _pg_async._give_back(db, pooled, connection, switched)
        assert await backend(db) not in (first, None)


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
        pooled._connection_record.starttime -= 3599.5
        await _pg_async._give_back(db, pooled, connection, switched)
        through_greenlet = 0
        raw_connection = sa_async.AsyncEngine.raw_connection

        async def counted(self: Any) -> Any:
            nonlocal through_greenlet
            through_greenlet += 1
            return await raw_connection(self)

        monkeypatch.setattr(sa_async.AsyncEngine, "raw_connection", counted)
        await backend(db)
        assert through_greenlet == 1


async def test_a_pinged_pool_finds_a_connection_the_server_ended(
    database_url: str, db: sa.Engine
) -> None:
    async with pool_of(database_url, pool_size=1, max_overflow=0, pool_pre_ping=True) as adb:
        first = await backend(adb)
        terminate(db, first)
        assert await backend(adb) not in (first, None)


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


async def test_last_in_first_out_hands_out_the_last_one_looked_at(database_url: str) -> None:
    """With ``pool_use_lifo`` the connection handed out is the last checked in: the one
    invalidated here, which the look must see, not the first in the queue."""
    async with pool_of(database_url, pool_size=2, max_overflow=0, pool_use_lifo=True) as db:
        kept, invalidated = await hold(db), await hold(db)
        pid = invalidated[1].info.backend_pid
        await _pg_async._give_back(db, *kept)
        invalidated[0].invalidate(soft=True)
        await _pg_async._give_back(db, *invalidated)
        assert await backend(db) != pid


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


async def test_every_checkout_works_whatever_happened_before(
    database_url: str, db: sa.Engine
) -> None:
    seen: list[list[str]] = []

    # hypothesis drives sync functions: the sequences are drawn first, then played.
    @settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(EVENTS, min_size=1, max_size=12), st.booleans())
    def draw(events: list[str], lifo: bool) -> None:
        seen.append([*events, "lifo" if lifo else "fifo"])

    draw()
    for *events, order in seen:
        async with pool_of(
            database_url,
            pool_size=2,
            max_overflow=1,
            pool_recycle=3600,
            pool_use_lifo=order == "lifo",
        ) as adb:
            held: list[tuple[Any, psycopg.AsyncConnection[Any], bool]] = []
            for event in events:
                if event == "hold" and len(held) < 2:  # one connection left to borrow
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
                    await greenlet_spawn(
                        _pg_async.drop_older_connections, adb.sync_engine.pool, pooled
                    )
                await _pg_async._give_back(adb, pooled, connection, switched)
                assert await backend(adb) > 0, events
            for pooled, connection, switched in held:
                await _pg_async._give_back(adb, pooled, connection, switched)
            assert adb.sync_engine.pool.checkedout() == 0, events
