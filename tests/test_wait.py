"""``wait=``: a duplicate waits for the call that holds its key, woken by that call's commit
(LISTEN/NOTIFY), on the session's PostgreSQL. Every run of the operation's step is a row of
``wait_runs``, counted where it lands.

The holder's lease outlasts every wait here; the waiter's listener is watched (what it
heard), so that a replay found at the end of the wait does not pass for one it was woken to."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcluster import wait_until
from rides import count

import recoverypoint as rp
from recoverypoint.engine import listen, waits

SCHEMA = """
CREATE TABLE IF NOT EXISTS wait_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item text NOT NULL
)
"""
@pytest.fixture
def engine(engine_both_ways: rp.Engine) -> rp.Engine:
    """Each test on both of the engine's paths (see conftest's engine_both_ways)."""
    return engine_both_ways


WAIT = 30  # seconds: far longer than any step here, far shorter than the lease
LEASE = timedelta(minutes=10)


@pytest.fixture(scope="module", autouse=True)
def table(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)


class Holder:
    """Holds the first run of each item inside its step until released."""

    def __init__(self) -> None:
        self.entered: dict[str, threading.Event] = {}
        self.released: dict[str, threading.Event] = {}
        self.fail: set[str] = set()

    def hold(self, item: str) -> None:
        self.entered.setdefault(item, threading.Event())
        self.released.setdefault(item, threading.Event())

    def step(self, item: str) -> None:
        if item in self.entered and not self.entered[item].is_set():
            self.entered[item].set()
            assert self.released[item].wait(60), "never released"
            if item in self.fail:
                raise RuntimeError("the first call failed")


def declared(holder: Holder) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(f"waited_{uuid.uuid4().hex[:8]}", lock_timeout=LEASE)

    @op.foreign_step("stepped")
    def step(ctx: rp.StepContext, params: Any) -> dict[str, Any]:
        holder.step(params["item"])
        return {}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.connection.execute(
            sa.text("INSERT INTO wait_runs (item) VALUES (:i)"), {"i": params["item"]}
        )
        return rp.Response(201, {"item": params["item"]})

    return op


def runs(db: sa.Engine, item: str) -> int:
    return count(db, "SELECT count(*) FROM wait_runs WHERE item = :i", i=item)


def listeners(db: sa.Engine) -> int:
    """Connections of this database that LISTEN and wait (idle, in no transaction)."""
    return count(
        db,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE '%%pg_advisory_lock_shared%%' AND state = 'idle'",
    )


def no_listener_left(db: sa.Engine) -> bool:
    """Whether every listener's backend has gone, within a minute: a connection closed by
    the engine leaves pg_stat_activity only once its backend has seen the close and
    exited, a moment later; one left open never does."""
    try:
        wait_until(lambda: listeners(db) == 0, "every listener's backend has gone")
    except TimeoutError:
        return False
    return True


class Heard(list[bool]):
    """What each wait of a listener ended with: True for a NOTIFY, False for its timeout;
    ``waiting`` is set once a listener has begun to wait (its claim again refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()


@pytest.fixture
def heard(monkeypatch: pytest.MonkeyPatch) -> Heard:
    ends = Heard()
    real = listen.KeyListener.heard

    def watched(self: listen.KeyListener, timeout: float) -> bool:
        ends.waiting.set()
        ends.append(real(self, timeout))
        return ends[-1]

    monkeypatch.setattr(listen.KeyListener, "heard", watched)
    return ends


def test_a_waiting_duplicate_gets_the_first_calls_answer_when_it_commits(
    engine: rp.Engine, db: sa.Engine, heard: Heard
) -> None:
    holder = Holder()
    op = declared(holder)
    engine.register(op)
    item = uuid.uuid4().hex
    holder.hold(item)
    params = {"item": item}

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(engine.run, op, key="k", params=params)
        assert holder.entered[item].wait(60)
        with pytest.raises(rp.KeyInUse):  # without wait=, as ever
            engine.run(op, key="k", params=params)
        checked_out = db.pool.checkedout()
        waiting = pool.submit(engine.run, op, key="k", params=params, wait=WAIT)
        # The waiter LISTENs on a connection of its own, idle, in no transaction, and
        # holds none of the pool's once its claim again has been refused.
        assert heard.waiting.wait(60)
        assert listeners(db) == 1
        assert db.pool.checkedout() == checked_out
        holder.released[item].set()
        answer, replay = first.result(60), waiting.result(60)

    assert not answer.replayed and replay.replayed
    assert heard == [True]  # woken by the commit's NOTIFY, once
    assert replay.body == answer.body == {"item": item}
    assert runs(db, item) == 1
    assert no_listener_left(db)  # closed after the wait


def test_a_waiting_duplicate_runs_the_key_itself_when_the_first_call_fails(
    engine: rp.Engine, db: sa.Engine, heard: Heard
) -> None:
    holder = Holder()
    op = declared(holder)
    engine.register(op)
    item = uuid.uuid4().hex
    holder.hold(item)
    holder.fail.add(item)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(engine.run, op, key="k", params={"item": item})
        assert holder.entered[item].wait(60)
        waiting = pool.submit(engine.run, op, key="k", params={"item": item}, wait=WAIT)
        assert heard.waiting.wait(60)
        holder.released[item].set()
        with pytest.raises(RuntimeError):
            first.result(60)
        ran = waiting.result(60)

    assert not ran.replayed and ran.status == 201
    assert heard == [True]  # woken by the release's NOTIFY
    assert runs(db, item) == 1


def test_a_wait_that_runs_out_is_key_in_use(engine: rp.Engine, db: sa.Engine) -> None:
    holder = Holder()
    op = declared(holder)
    engine.register(op)
    item = uuid.uuid4().hex
    holder.hold(item)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(engine.run, op, key="k", params={"item": item})
        assert holder.entered[item].wait(60)
        with pytest.raises(rp.KeyInUse):
            engine.run(op, key="k", params={"item": item}, wait=timedelta(milliseconds=200))
        holder.released[item].set()
        first.result(60)
    assert runs(db, item) == 1 and no_listener_left(db)


def test_a_waiter_whose_connection_dies_is_answered_key_in_use(
    engine: rp.Engine, db: sa.Engine, heard: Heard
) -> None:
    holder = Holder()
    op = declared(holder)
    engine.register(op)
    item = uuid.uuid4().hex
    holder.hold(item)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(engine.run, op, key="k", params={"item": item})
        assert holder.entered[item].wait(60)
        waiting = pool.submit(engine.run, op, key="k", params={"item": item}, wait=WAIT)
        assert heard.waiting.wait(60)
        with db.begin() as conn:  # the waiter's connection is cut, as a restart would
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'idle' "
                    "AND query LIKE '%%pg_advisory_lock_shared%%'"
                )
            )
        with pytest.raises(rp.KeyInUse):
            waiting.result(60)
        holder.released[item].set()
        first.result(60)
    assert runs(db, item) == 1


def test_waiters_beyond_the_engines_limit_are_answered_at_once(
    engine: rp.Engine, db: sa.Engine
) -> None:
    holder = Holder()
    op = declared(holder)
    engine.register(op)
    item = uuid.uuid4().hex
    holder.hold(item)
    taken = [engine._wait_slots.take() for _ in range(waits.MAX_WAITERS)]
    assert all(taken)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(engine.run, op, key="k", params={"item": item})
            assert holder.entered[item].wait(60)
            with pytest.raises(rp.KeyInUse):  # no slot: no wait, no connection
                engine.run(op, key="k", params={"item": item}, wait=WAIT)
            assert listeners(db) == 0
            holder.released[item].set()
            first.result(60)
    finally:
        for _ in taken:
            engine._wait_slots.give_back()


def test_the_async_engine_waits_on_the_event_loop(database_url: str, db: sa.Engine) -> None:
    op: rp.Operation[Any] = rp.Operation(f"waited_{uuid.uuid4().hex[:8]}", lock_timeout=LEASE)
    item = uuid.uuid4().hex
    entered, released = asyncio.Event(), asyncio.Event()

    @op.foreign_step("stepped")
    async def step(ctx: rp.StepContext, params: Any) -> dict[str, Any]:
        if not entered.is_set():
            entered.set()
            await released.wait()
        return {}

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        await tx.execute("INSERT INTO wait_runs (item) VALUES (%(i)s)", {"i": item})
        return rp.Response(201, {"item": item})

    async def main() -> tuple[rp.Outcome, rp.Outcome]:
        engine = rp.AsyncEngine(database_url)
        engine.register(op)
        try:
            first = asyncio.create_task(engine.run(op, key="k", params={}))
            await entered.wait()
            waiting = asyncio.create_task(engine.run(op, key="k", params={}, wait=WAIT))
            while not await asyncio.to_thread(listeners, db):
                await asyncio.sleep(0.05)
            released.set()
            return await first, await waiting
        finally:
            await engine.dispose()

    answer, replay = asyncio.run(main())
    assert not answer.replayed and replay.replayed and replay.body == answer.body
    assert runs(db, item) == 1


@settings(max_examples=200)
@given(
    wait=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.timedeltas(),
        st.booleans(),
        st.text(max_size=5),
        st.none(),
    )
)
def test_any_wait_is_seconds_within_the_cap_or_refused(wait: Any) -> None:
    try:
        seconds = waits.wait_seconds(wait)
    except ValueError:
        return
    assert 0 <= seconds <= waits.MAX_WAIT.total_seconds()
    assert wait is None or not isinstance(wait, bool | str)


@pytest.mark.parametrize("wait", [-1, float("nan"), float("inf"), 61, timedelta(hours=1), "5"])
def test_a_bad_wait_is_a_value_error_and_stores_nothing(
    engine: rp.Engine, db: sa.Engine, wait: Any
) -> None:
    op = declared(Holder())
    engine.register(op)
    with pytest.raises(ValueError, match="wait"):
        engine.run(op, key="k", params={"item": "x"}, wait=wait)
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE operation = :o", o=op.name) == 0


@settings(max_examples=100)
@given(scope=st.text(max_size=50), name=st.text(min_size=1, max_size=50), key=st.text(max_size=50))
def test_the_channel_and_lock_python_computes_are_the_ones_postgresql_uses(
    db: sa.Engine, scope: str, name: str, key: str
) -> None:
    if "\x00" in scope + name + key or not (scope + name + key).isprintable():
        return  # never stored: refused before any key is claimed
    identity = "md5(:s || chr(31) || :o || chr(31) || :k)"
    with db.connect() as conn:
        channel, lock = conn.execute(
            sa.text(
                f"SELECT 'recoverypoint_' || {identity}, "
                f"('x' || left({identity}, 16))::bit(64)::bigint"
            ),
            {"s": scope, "o": name, "k": key},
        ).one()
    assert channel == waits.channel(scope, name, key)
    assert lock == waits.lock(scope, name, key)


@pytest.mark.slow
def test_a_notify_is_sent_only_while_a_call_waits(engine: rp.Engine, database_url: str) -> None:
    """The NOTIFY of a finish: none for a key nobody waits on (PostgreSQL commits notifying
    transactions one at a time); one for a key whose waiter holds its lock."""
    op = declared(Holder())
    engine.register(op)
    url = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        for key in ("alone", "awaited"):
            conn.execute(f'LISTEN "{waits.channel("", op.name, key)}"')
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (waits.lock("", op.name, "awaited"),))
        engine.run(op, key="alone", params={"item": uuid.uuid4().hex})
        engine.run(op, key="awaited", params={"item": uuid.uuid4().hex})
        # Both commits are done: whatever they sent is queued for this connection.
        heard = [n.channel for n in conn.notifies(timeout=1, stop_after=2)]
    assert heard == [waits.channel("", op.name, "awaited")]
