"""A live holder keeps its lease (recoverypoint.engine.heartbeat), on both engines, against
real PostgreSQL: a foreign step three times longer than its lease is never run a second
time beside itself, by a client's retry or the completer; a holder killed mid-step is
taken over within its lock timeout, with the same downstream key; a lease an operator
releases by force mid-step is seen by the step (``lease_lost``) and fences its commit. And
an atomic phase needs no heartbeat: one longer than its lease keeps its key, as its row is
locked until its commit renews the lease.

Waits are on events and on the database (its rows, its clock), never on this host's clock;
the short pauses between polls only pace them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from heartbeats import LEASE, SCHEMA, Mailer, operation

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.workers import Completer

T = TypeVar("T")
CHILD = Path(__file__).with_name("heartbeat_child.py")
POLL = 0.02


class Driver:
    """One engine, driven from the test's thread: rp.Engine as it is, rp.AsyncEngine on an
    event loop in a thread of its own."""

    def __init__(self, kind: str, engine: rp.Engine | rp.AsyncEngine) -> None:
        self.kind, self.engine = kind, engine
        self.loop: asyncio.AbstractEventLoop | None = None
        if isinstance(engine, rp.AsyncEngine):
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()

    def start(self, op: rp.Operation[Any], scope: str) -> Future[rp.Outcome]:
        """A request with key ``k`` in ``scope``, running in the background."""
        params = {"scope": scope}
        return self.submit(self.engine.run, operation=op, key="k", params=params, scope=scope)

    def submit(self, fn: Callable[..., Any], **kwargs: Any) -> Future[Any]:
        """``fn(**kwargs)`` in the background: in a thread, or awaited on the loop."""
        if self.loop is not None:
            return asyncio.run_coroutine_threadsafe(fn(**kwargs), self.loop)
        future: Future[Any] = Future()

        def call() -> None:
            try:
                future.set_result(fn(**kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=call, daemon=True).start()
        return future

    def run(self, op: rp.Operation[Any], scope: str) -> rp.Outcome:
        return self.start(op, scope).result(60)

    def close(self) -> None:
        if isinstance(self.engine, rp.AsyncEngine):
            assert self.loop is not None
            asyncio.run_coroutine_threadsafe(self.engine.dispose(), self.loop).result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(60)
            self.loop.close()
        else:
            self.engine.dispose()


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest, database_url: str) -> Iterator[Driver]:
    kind = request.param
    engine = rp.Engine(database_url) if kind == "sync" else rp.AsyncEngine(database_url)
    with engine.db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    driver = Driver(kind, engine)
    yield driver
    driver.close()


def until(found: Callable[[], T | None], what: str) -> T:
    """Poll ``found`` until it finds something; fail after a minute."""
    deadline = time.monotonic() + 60
    while (value := found()) is None or value is False:
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(POLL)
    return value


def one(db: sa.Engine, sql: str, **params: Any) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.text(sql), params).one()


def sends(db: sa.Engine, scope: str) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT * FROM heartbeat_sends WHERE scope = :s ORDER BY id"), {"s": scope}
            )
        )


def key_row(db: sa.Engine, scope: str) -> Any:
    return one(db, "SELECT *, now() AS db_now FROM idempotency_keys WHERE scope = :s", s=scope)


def test_a_step_three_times_longer_than_its_lease_keeps_its_key(driver: Driver, scope: str) -> None:
    """Retries and completer passes beside the step, for three lock timeouts on the
    database's clock: each is refused; the provider is called once."""
    db = driver.engine.db
    mailer = Mailer(db)
    op = operation(driver.kind, mailer)
    driver.engine.register(op)
    first = driver.start(op, scope)
    assert mailer.calling.wait(60)
    began = sends(db, scope)[0].sent_at
    completer = Completer(driver.engine, min_age=0)
    refused, leases = 0, set()
    while True:
        with pytest.raises(rp.KeyInUse):
            driver.run(op, scope)
        refused += 1
        assert completer.run_once().finished == 0
        row = key_row(db, scope)
        leases.add(row.locked_at)
        if row.db_now - began > timedelta(seconds=3 * LEASE):
            break
        time.sleep(POLL)
    completer.close()
    mailer.gate.set()
    outcome = first.result(60)
    assert outcome.status == 201 and outcome.body == {"lost": False}
    assert len(sends(db, scope)) == 1  # one call at the provider, whatever the retries
    assert len(leases) >= 4, "the lease was renewed while the step ran"
    assert refused > 1
    assert key_row(db, scope).lock_token is None


def test_a_killed_holder_is_taken_over_within_its_lock_timeout(
    driver: Driver, database_url: str, scope: str
) -> None:
    """The child renews its lease past its lock timeout, is killed mid-call, and a retry
    takes the key over within the lock timeout (and a margin), with the same downstream
    key."""
    db = driver.engine.db
    child = subprocess.Popen(
        [sys.executable, str(CHILD), database_url, scope, driver.kind],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def renewed_past_its_lease() -> bool | None:
            assert child.poll() is None, "the child died by itself"
            calls = sends(db, scope)
            if not calls:
                return None
            return key_row(db, scope).locked_at > calls[0].sent_at + timedelta(seconds=LEASE)

        until(renewed_past_its_lease, "the child to renew its lease past its lock timeout")
    finally:
        child.kill()
        _, stderr = child.communicate(timeout=60)
    assert child.returncode == -9, stderr
    killed_at: datetime = one(db, "SELECT now()")[0]
    mailer = Mailer(db)
    mailer.gate.set()
    op = operation(driver.kind, mailer)
    driver.engine.register(op)

    def taken_over() -> rp.Outcome | None:
        try:
            return driver.run(op, scope)
        except rp.KeyInUse:
            return None

    outcome = until(taken_over, "the key to be taken over")
    assert outcome.status == 201
    first, second = sends(db, scope)
    assert first.downstream_key == second.downstream_key
    assert second.sent_at - killed_at < timedelta(seconds=LEASE + 1.0)


def test_a_lease_released_by_force_mid_step_is_lost(
    driver: Driver, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``keys release --force`` while the step runs: a renewal finds the token gone, the
    step sees ``lease_lost``, and its result is not committed (LockLost)."""
    db = driver.engine.db
    mailer = Mailer(db)
    op = operation(driver.kind, mailer)
    driver.engine.register(op)
    first = driver.start(op, scope)
    assert mailer.calling.wait(60)
    [step] = mailer.steps
    assert not step.lease_lost
    key_id = key_row(db, scope).id
    assert admin.release(admin.Admin.for_engine(driver.engine), key_id, force=True).changed == (
        key_id,
    )
    until(lambda: step.lease_lost, "the step to see its lease lost")
    assert f"key {key_id} lost its lease while a foreign step ran" in caplog.text
    mailer.gate.set()
    with pytest.raises(rp.LockLost):
        first.result(60)
    row = key_row(db, scope)
    assert (row.recovery_point, row.lock_token, row.state) == ("begun", None, {})
    assert len(sends(db, scope)) == 1


def test_an_atomic_phase_longer_than_its_lease_keeps_its_key(driver: Driver, scope: str) -> None:
    """No heartbeat needed: the phase's fence locks the key row, so a retry waits for it
    and the completer skips it, however long the phase runs; its commit renews the lease."""
    db = driver.engine.db
    entered, gate, calls = threading.Event(), threading.Event(), []

    def hold(tx: Any, params: Any) -> None:
        calls.append(1)
        entered.set()
        gate.wait()

    op: rp.Operation[Any] = rp.Operation("slow_phase", lock_timeout=timedelta(seconds=LEASE))
    if driver.kind == "sync":
        op.atomic_phase("begun")(lambda tx, params: None)
        op.atomic_phase("held")(hold)
        op.atomic_phase("done")(lambda tx, params: rp.Response(201))
    else:

        async def nothing(tx: Any, params: Any) -> None:
            return None

        async def ahold(tx: Any, params: Any) -> None:
            await asyncio.to_thread(hold, tx, params)

        async def done(tx: Any, params: Any) -> rp.Response:
            return rp.Response(201)

        op.atomic_phase("begun")(nothing)
        op.atomic_phase("held")(ahold)
        op.atomic_phase("done")(done)
    driver.engine.register(op)
    first = driver.start(op, scope)
    try:
        assert entered.wait(60)
        until(
            lambda: (row := key_row(db, scope)).db_now - row.locked_at > timedelta(seconds=LEASE),
            "the lease to outlive its lock timeout",
        )
        retry = driver.start(op, scope)  # finds the lease run out, and waits for the row
        waiting = """
            SELECT count(*) > 0 FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'
        """
        until(lambda: one(db, waiting)[0], "the retry to wait for the key row")
        completer = Completer(driver.engine, min_age=0)
        assert completer.run_once().finished == 0
        completer.close()
    finally:
        gate.set()
    assert first.result(60).status == 201
    try:
        answered: rp.Outcome | None = retry.result(60)
    except rp.KeyInUse:
        answered = None  # it read the key between "held" and "done"
    assert answered is None or answered.replayed
    assert calls == [1]


def test_an_idempotent_call_longer_than_its_lease_keeps_its_key(driver: Driver, scope: str) -> None:
    """``@idempotent`` is an operation of one foreign step: a call past its lock timeout
    keeps its key; a second call with it gets KeyInUse, and the function runs once."""
    db = driver.engine.db
    entered, gate, calls = threading.Event(), threading.Event(), []

    def body(order_id: str) -> str:
        calls.append(order_id)
        entered.set()
        gate.wait(120)  # the test opens it; a failed one must not hang
        return "sent"

    options: dict[str, Any] = {
        "key": "order_id",
        "scope": lambda arguments: scope,
        "name": "notify_once",
        "lock_timeout": timedelta(seconds=LEASE),
    }
    fn: Callable[..., Any]
    if isinstance(driver.engine, rp.Engine):
        fn = rp.idempotent(driver.engine, **options)(body)
    else:

        @rp.idempotent(driver.engine, **options)
        async def fn(order_id: str) -> str:
            return await asyncio.to_thread(body, order_id)

    def call() -> Future[Any]:
        return driver.submit(fn, order_id="o1")

    first = call()
    try:
        assert entered.wait(60)
        began = key_row(db, scope).locked_at
        until(
            lambda: key_row(db, scope).db_now - began > timedelta(seconds=2 * LEASE),
            "two lock timeouts to pass",
        )
        with pytest.raises(rp.KeyInUse):
            call().result(60)
    finally:
        gate.set()
    assert first.result(60) == "sent"
    assert calls == ["o1"]
