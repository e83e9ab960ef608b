"""The async engine's wait (recoverypoint.engine._waiter) on asyncio's loop and on uvloop,
against the session's PostgreSQL. A pooled connection's socket is registered once, at the
engine's first borrow of it on a loop (again only if the loop stopped watching it), and
let go when the pool closes the connection; a borrow on another loop gets a waiter of that
loop, and the last loop's registration goes; the application's own use of the pool on
another loop waits psycopg's way. A request cancelled in the middle of a statement cancels
it on the server; a connection the server drops while it is borrowed, or while it rests
in the pool, neither spins the loop, nor hangs the request (on uvloop, libuv stops watching
a socket that reports an error: the waiter's look finds it), nor leaves a stale
registration behind for the next connection to trip over; a statement larger than the
socket's buffer goes out whole."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import os
import resource
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from anyio import fail_after
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.waiting import Ready
from rides import count

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.engine import _waiter

pytestmark = pytest.mark.anyio
APPLICATION = "recoverypoint-waiter-tests"


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "uvloop":
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


class Phase:
    """What the operation's one atomic phase does, set by each test."""

    def __init__(self) -> None:
        self.sql = "SELECT 1"
        self.value: Any = None
        self.entered = asyncio.Event()
        self.go_on: asyncio.Event | None = None
        self.pid: int | None = None
        self.answer: Any = None


@pytest.fixture
async def phase() -> Phase:
    return Phase()


@pytest.fixture
async def engine(
    database_url: str, business_tables: None, phase: Phase
) -> AsyncIterator[rp.AsyncEngine]:
    # One connection: every request and every retry takes the same one, or its successor.
    async_db = sa_async.create_async_engine(
        normalize_url(database_url),
        pool_size=1,
        max_overflow=0,
        connect_args={"application_name": APPLICATION},
    )
    engine = rp.AsyncEngine(async_db)
    op: rp.Operation[Any] = rp.Operation("waited_on")

    @op.atomic_phase("finished")
    async def run(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        phase.pid = await tx.scalar("SELECT pg_backend_pid()")
        phase.entered.set()
        if phase.go_on is not None:
            await phase.go_on.wait()
        phase.answer = await tx.scalar(phase.sql, None if phase.value is None else (phase.value,))
        return rp.Response(201, {"answer": str(phase.answer)[:20]})

    engine.register(op)
    yield engine
    assert async_db.pool.checkedout() == 0, "a connection was left checked out"  # type: ignore[attr-defined]
    await engine.dispose()
    await async_db.dispose()


RUN = uuid.uuid4().hex[:8]  # the keys of this module's run (both loops share a database)


async def request(engine: rp.AsyncEngine, key: str | None = None) -> rp.Outcome:
    """The operation once, under ``key`` (the loop's own) or a new key."""
    (op,) = engine.operations
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return await engine.run(op, key=f"{RUN}-{loop}-{key or uuid.uuid4().hex}", params={})


def active(db: sa.Engine, query: str) -> int:
    return count(
        db,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = :a "
        "AND state = 'active' AND query LIKE :q",
        a=APPLICATION,
        q=query,
    )


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per time the loop found a waiter's socket readable, from here on."""
    calls: list[bool] = []
    readable = _waiter.Waiter._readable

    def counted(self: _waiter.Waiter) -> None:
        calls.append(True)
        readable(self)

    monkeypatch.setattr(_waiter.Waiter, "_readable", counted)
    return calls


@pytest.fixture
def waiters(monkeypatch: pytest.MonkeyPatch) -> list[_waiter.Waiter]:
    """Every waiter made from here on, the last borrow's last."""
    made: list[_waiter.Waiter] = []
    init = _waiter.Waiter.__init__

    def counted(self: _waiter.Waiter, connection: Any) -> None:
        init(self, connection)
        made.append(self)

    monkeypatch.setattr(_waiter.Waiter, "__init__", counted)
    return made


def watched(loop: asyncio.AbstractEventLoop) -> set[int] | None:
    """The sockets asyncio's loop watches for reading; ``None`` on uvloop, which tells
    nobody."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return None
    return {key.fd for key in selector.get_map().values() if key.events & 1}  # EVENT_READ


async def test_a_socket_is_registered_once_per_connection_and_let_go_when_it_closes(
    engine: rp.AsyncEngine,
    waiters: list[_waiter.Waiter],
    monkeypatch: pytest.MonkeyPatch,
    anyio_backend: Any,
) -> None:
    registered: list[int] = []
    loop = asyncio.get_running_loop()
    if anyio_backend == "asyncio":  # uvloop's methods cannot be wrapped on the instance
        add, remove = loop.add_reader, loop.remove_reader
        monkeypatch.setattr(loop, "add_reader", lambda fd, *a: (registered.append(fd), add(fd, *a)))
        monkeypatch.setattr(loop, "remove_reader", lambda fd: (registered.remove(fd), remove(fd)))

    for _ in range(5):  # two borrows each
        assert (await request(engine)).status == 201
    outcome = await request(engine, "again")
    assert (await request(engine, "again")).replayed and outcome.status == 201
    # The pool's one connection, one waiter for its twelve borrows, its socket registered
    # once and watched meanwhile.
    (waiter,) = waiters
    assert waiter.loop is loop and waiter.socket is not None
    socket = waiter.socket
    if anyio_backend == "asyncio":
        assert registered == [socket]
    await engine.async_db.dispose()  # the pool closes its connection: the socket goes first
    assert waiter.socket is None and registered == []
    assert socket not in (watched(loop) or set())


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return type(loop).__module__.split(".")[0]


async def test_a_connection_borrowed_on_a_new_loop_once_the_last_closed_gets_a_waiter_there(
    engine: rp.AsyncEngine, waiters: list[_waiter.Waiter], db: sa.Engine
) -> None:
    names: list[str] = []

    def elsewhere(key: str) -> None:  # a loop of its own, closed after (asyncio.run)
        async def main() -> None:
            names.append(loop_name(asyncio.get_running_loop()))
            assert (await request(engine, key)).status == 201

        asyncio.run(main())

    await asyncio.to_thread(elsewhere, "first")
    await asyncio.to_thread(elsewhere, "second")
    assert (await request(engine, "here")).status == 201
    loop = asyncio.get_running_loop()
    # One waiter per loop; each closed loop's let go by the next borrow.
    assert len(waiters) == 3 and waiters[-1].loop is loop
    assert waiters[0].socket is None and waiters[1].socket is None
    keys = [f"{RUN}-{names[0]}-first", f"{RUN}-{names[1]}-second", f"{RUN}-{loop_name(loop)}-here"]
    query = "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (:a, :b, :c)"
    assert count(db, query, a=keys[0], b=keys[1], c=keys[2]) == 3


async def test_a_pool_shared_with_a_loop_that_runs_beside_the_waiters_serves_both(
    engine: rp.AsyncEngine, waiters: list[_waiter.Waiter], db: sa.Engine
) -> None:
    loop = asyncio.get_running_loop()
    before = watched(loop)
    assert (await request(engine, "here")).status == 201

    def elsewhere() -> tuple[int, str]:
        async def main() -> tuple[int, str]:
            # The application's own query, then the engine's request, on a loop that runs
            # while this one does (SQLAlchemy asks for a pool per loop; one shared is not
            # broken by the engine): this loop lets the socket go, the other one waits.
            async with engine.async_db.connect() as conn:
                value = (await conn.execute(sa.text("SELECT 41 + 1"))).scalar_one()
            assert (await request(engine, "there")).status == 201
            return value, loop_name(asyncio.get_running_loop())

        return asyncio.run(main())

    value, there = await asyncio.to_thread(elsewhere)
    assert value == 42
    assert (await request(engine, "here")).replayed
    assert (await request(engine, "again")).status == 201
    # Whichever waiters served meanwhile, one of this loop's serves now, and only its
    # socket is watched here.
    serving = waiters[-1]
    assert serving.loop is loop and serving.socket is not None
    assert all(w.socket is None for w in waiters[:-1])
    if before is not None:
        assert watched(loop) == before | {serving.socket}
    keys = [f"{RUN}-{there}-there", f"{RUN}-{loop_name(loop)}-again"]
    query = "SELECT count(*) FROM idempotency_keys WHERE idempotency_key IN (:a, :b)"
    assert count(db, query, a=keys[0], b=keys[1]) == 2


async def test_a_connection_closed_on_another_thread_is_closed_by_its_waiters_loop(
    engine: rp.AsyncEngine, waiters: list[_waiter.Waiter], db: sa.Engine
) -> None:
    assert (await request(engine, "closed-elsewhere")).status == 201
    (waiter,) = waiters
    # The pool disposed of on another thread's loop while this loop runs, held up meanwhile
    # (no task of it runs until the other thread is done).
    other = threading.Thread(target=lambda: asyncio.run(engine.async_db.dispose()))
    other.start()
    other.join()
    # A new socket of this loop, made at once: had the other thread closed the connection,
    # its number would be free, this socket would take it, and the loop, still holding the
    # old registration, would never watch it.
    await a_new_socket_is_heard()
    assert waiter.socket is None  # this loop let it go, then closed it
    connection = waiter.connection
    await connection.close()  # again, here: closed already, and not broken
    assert connection.closed and not connection.broken
    with fail_after(30):
        while count(db, ACTIVE_HERE, a=APPLICATION):
            await asyncio.sleep(0.01)


ACTIVE_HERE = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"


async def a_new_socket_is_heard() -> None:
    """A socket made now (likely on the lowest free number: a connection's just closed) is
    watched by the running loop: nothing stale of a registration before is in its way."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        heard = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(ours.fileno(), heard.set)
        try:
            theirs.send(b"x")
            with fail_after(30):
                await heard.wait()
        finally:
            loop.remove_reader(ours.fileno())


@pytest.mark.parametrize("collected_on", ["the loop's thread", "another thread"])
@pytest.mark.filterwarnings("ignore::ResourceWarning")  # psycopg's: deleted while open
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_connection_nobody_closes_is_collected_and_leaves_the_loop(
    database_url: str, db: sa.Engine, collected_on: str
) -> None:
    loop = asyncio.get_running_loop()
    before = watched(loop)
    application = f"{APPLICATION}-{uuid.uuid4().hex[:8]}"
    async_db = sa_async.create_async_engine(
        normalize_url(database_url), connect_args={"application_name": application}
    )
    engine = rp.AsyncEngine(async_db)
    op: rp.Operation[Any] = rp.Operation("dropped_engine")

    @op.atomic_phase("finished")
    async def run(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"answer": await tx.scalar("SELECT 1")})

    engine.register(op)
    assert (await engine.run(op, key=uuid.uuid4().hex, params={})).status == 201
    assert count(db, ACTIVE_HERE, a=application) == 1
    del engine, async_db, run, op  # dropped without dispose(): its connection with it
    with fail_after(30):
        while count(db, ACTIVE_HERE, a=application):
            if collected_on == "another thread":
                await asyncio.to_thread(gc.collect)  # the loop is handed the close
            else:
                gc.collect()
            await asyncio.sleep(0.01)
    await a_new_socket_is_heard()
    if before is not None:
        assert watched(loop) == before


async def test_a_connection_dropped_while_resting_in_the_pool_neither_spins_the_loop_nor_stays(
    engine: rp.AsyncEngine,
    phase: Phase,
    waiters: list[_waiter.Waiter],
    db: sa.Engine,
    woken: list[bool],
) -> None:
    loop = asyncio.get_running_loop()
    before = watched(loop)
    assert (await request(engine, "rested")).status == 201
    (resting,) = waiters
    assert engine.async_db.pool.checkedin() == 1  # type: ignore[attr-defined]
    woken.clear()
    with db.connect() as conn:  # the server drops the pooled connection while it rests
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": phase.pid})
    with fail_after(30):  # the dead socket wakes the loop
        while not woken:
            await asyncio.sleep(0)
    for _ in range(500):  # at most twice however the loop turns: then the socket rests
        await asyncio.sleep(0)
    assert len(woken) <= 2
    # The next request finds the connection dead (the database's loss, said so); the pool
    # drops it, its socket let go, and the requests after it run on a new one.
    with contextlib.suppress(rp.DatabaseUnavailable):
        await request(engine, "rested")
    assert resting.socket is None
    for n in range(3):
        assert (await request(engine, f"after-rest-{n}")).status == 201
    assert (await request(engine, "rested")).replayed
    live = [w.socket for w in waiters if w.socket is not None]
    assert len(live) == 1
    if before is not None:
        assert watched(loop) == before | set(live)


async def test_a_request_cancelled_mid_statement_cancels_it_on_the_server(
    engine: rp.AsyncEngine, phase: Phase, db: sa.Engine
) -> None:
    phase.sql = "SELECT pg_sleep(600)"
    task = asyncio.create_task(request(engine, "slow"))
    with fail_after(60):
        await phase.entered.wait()
    while not active(db, "SELECT pg_sleep(600)%"):
        await asyncio.sleep(0.01)
    task.cancel()
    with fail_after(60), pytest.raises(asyncio.CancelledError):
        await task
    # psycopg's own cancel ran: the statement is gone from the server within moments (the
    # server acts on a cancel request as it comes), not when the backend next notices its
    # client, after the 600 s sleep.
    with fail_after(30):
        while active(db, "SELECT pg_sleep(600)%"):
            await asyncio.sleep(0.01)
    phase.sql = "SELECT 2"
    assert (await request(engine, "slow")).body == {"answer": "2"}


async def test_a_connection_dropped_while_borrowed_neither_spins_the_loop_nor_stays_registered(
    engine: rp.AsyncEngine, phase: Phase, db: sa.Engine, woken: list[bool]
) -> None:
    phase.go_on = asyncio.Event()
    task = asyncio.create_task(request(engine, "dropped"))
    with fail_after(60):
        await phase.entered.wait()
    with db.connect() as conn:  # the server drops the phase's connection between statements
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": phase.pid})
    woken.clear()
    for _ in range(500):  # the loop turns; the dead socket wakes it twice, not every turn
        await asyncio.sleep(0)
    assert len(woken) <= 3
    phase.go_on.set()
    with fail_after(60), pytest.raises(rp.IdempotencyError):  # a hang fails here, named
        await task
    # The next connection may get the dropped one's descriptor number: nothing stale of the
    # last registration is in its way, and its requests run.
    phase.go_on = None
    for n in range(3):
        assert (await request(engine, f"after-{n}")).status == 201
    assert (await request(engine, "dropped")).status == 201


async def test_a_loop_that_stops_watching_the_socket_does_not_hang_the_request(
    engine: rp.AsyncEngine,
    phase: Phase,
    waiters: list[_waiter.Waiter],
    monkeypatch: pytest.MonkeyPatch,
    anyio_backend: Any,
) -> None:
    # As libuv does when the socket reports an error (its last call of the reader may come
    # while no wait is pending): here always, so that the look, not a race with the
    # server's reset, is what this test holds to.
    loop = asyncio.get_running_loop()
    watched_again: list[bool] = []
    register_again = _waiter.Waiter._register_again

    def seen(self: _waiter.Waiter, socket: int) -> None:
        register_again(self, socket)
        if anyio_backend == "asyncio":  # uvloop tells nobody what it watches
            watched_again.append(socket in loop._selector.get_map())  # type: ignore[attr-defined]
        else:
            watched_again.append(True)

    monkeypatch.setattr(_waiter.Waiter, "_register_again", seen)
    phase.go_on = asyncio.Event()
    task = asyncio.create_task(request(engine, "unwatched"))
    with fail_after(60):
        await phase.entered.wait()
    borrowing = waiters[-1]
    assert borrowing.socket is not None
    loop.remove_reader(borrowing.socket)  # behind the waiter's back
    phase.go_on.set()
    with fail_after(30):  # without the look, the phase's next statement waits forever
        outcome = await task
    assert outcome.status == 201 and phase.answer == 1
    assert watched_again and all(watched_again)  # the look gave the socket back to the loop
    assert (await request(engine, "unwatched")).replayed


async def test_a_statement_larger_than_the_socket_buffer_goes_out_whole(
    engine: rp.AsyncEngine, phase: Phase
) -> None:
    phase.sql = "SELECT length(%s)"
    phase.value = "x" * (32 * 1024 * 1024)
    assert (await request(engine)).body == {"answer": str(32 * 1024 * 1024)}


async def test_a_connection_on_a_descriptor_past_1023_goes_out_whole(
    engine: rp.AsyncEngine, phase: Phase
) -> None:
    # select() cannot watch a descriptor number past 1023: the waiter's own look at the
    # socket (for writing here, a statement larger than the socket's buffer) must not use it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    taken: list[int] = []
    try:
        while not taken or taken[-1] < 1024:
            taken.append(os.open(os.devnull, os.O_RDONLY))
        phase.sql = "SELECT length(%s)"
        phase.value = "x" * (32 * 1024 * 1024)
        assert (await request(engine)).body == {"answer": str(32 * 1024 * 1024)}
    finally:
        for descriptor in taken:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_requests_cancelled_after_any_number_of_loop_turns_leave_nothing(
    engine: rp.AsyncEngine, db: sa.Engine, waiters: list[_waiter.Waiter]
) -> None:
    loop = asyncio.get_running_loop()
    before = watched(loop)
    turns: list[int] = []

    @settings(max_examples=40, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 40))
    def draw(n: int) -> None:  # hypothesis drives sync functions: drawn first, then run
        turns.append(n)

    draw()
    for index, n in enumerate(turns):
        key = f"cut-{index}"
        task = asyncio.create_task(request(engine, key))
        for _ in range(n):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # Whatever was cut, the connection went back, the key answers, and the loop
        # watches the pool's one connection, through its waiter, and nothing else.
        assert engine.async_db.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert (await request(engine, key)).status == 201
        live = [w.socket for w in waiters if w.socket is not None]
        assert len(live) == 1
        if before is not None:
            assert watched(loop) == before | set(live)
    loop_name = type(loop).__module__.split(".")[0]
    made = count(
        db,
        "SELECT count(*) FROM idempotency_keys WHERE idempotency_key LIKE :k",
        k=f"{RUN}-{loop_name}-cut-%",
    )
    assert made == len(turns)


class _Psycopg31:
    async def wait(self, gen: Any, timeout: float | None = 0.1) -> Any: ...


class _Psycopg32:
    async def wait(self, gen: Any, interval: float | None = 0.1) -> Any: ...


class _Psycopg33:
    async def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any: ...


class _WaitsWithMore:  # a psycopg whose own code would pass what the waiter does not take
    async def wait(self, gen: Any, interval: float = 0.1, *, deadline: float = 0.0) -> Any: ...


class _WaitsBlocking:
    def wait(self, gen: Any) -> Any: ...


class _WaitsNot:
    pass


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("connection_class", "fits"),
    [
        (_Psycopg31, True),
        (_Psycopg32, True),
        (_Psycopg33, True),
        (_WaitsWithMore, False),
        (_WaitsBlocking, False),
        (_WaitsNot, False),
    ],
)
async def test_the_waiter_stands_in_only_for_a_wait_it_knows(
    connection_class: type, fits: bool
) -> None:
    assert _waiter.fits(connection_class) is fits


class _ReadyOf31(enum.IntFlag):  # psycopg 3.1's Ready: no NONE
    R = 1
    W = 2


def test_the_waiter_stands_in_only_where_psycopg_has_the_flags_it_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _waiter.fits(_Psycopg33)
    monkeypatch.setattr(_waiter, "Ready", _ReadyOf31)
    assert not _waiter.fits(_Psycopg33)
    monkeypatch.setattr(_waiter, "Ready", Ready)
    monkeypatch.setattr(_waiter, "Wait", _ReadyOf31)  # no RW
    assert not _waiter.fits(_Psycopg33)


async def test_a_psycopg_whose_wait_the_waiter_does_not_know_keeps_its_own(
    engine: rp.AsyncEngine,
    waiters: list[_waiter.Waiter],
    phase: Phase,
    monkeypatch: pytest.MonkeyPatch,
    database_url: str,
) -> None:
    monkeypatch.setattr(_waiter, "FITS", False)
    phase.sql = "SELECT %s::int * 2"
    phase.value = 21
    key = uuid.uuid4().hex
    first = await request(engine, key)
    again = await request(engine, key)
    assert (first.status, first.body) == (201, {"answer": "42"})
    assert (again.status, again.body, again.replayed) == (201, {"answer": "42"}, True)
    assert waiters == []  # psycopg's own wait served every round trip
    db = sa.create_engine(normalize_url(database_url))
    try:
        query = "SELECT count(*) FROM idempotency_keys WHERE idempotency_key LIKE :k"
        assert count(db, query, k=f"%{key}") == 1
    finally:
        db.dispose()
