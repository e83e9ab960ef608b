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
import os
import socket
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
from sqlalchemy.ext.asyncio import create_async_engine

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.engine import heartbeat
from recoverypoint.workers import Completer

# On one worker: most of these tests' time is waiting out leases, which on several workers
# at once would leave the machine's cores idle.
pytestmark = pytest.mark.xdist_group("heartbeat")

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


@pytest.mark.slow
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


@pytest.mark.slow
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
    taken_over_after_death(driver, scope)


def taken_over_after_death(driver: Driver, scope: str) -> None:
    """The holder of key ``k`` in ``scope`` was just killed: a retry takes its key over
    within its lock timeout (and a margin), with the same downstream key."""
    db = driver.engine.db
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


@pytest.mark.slow
def test_a_forked_child_renews_none_of_its_parents_leases(
    driver: Driver, database_url: str, scope: str
) -> None:
    """A process forks mid-step (a pre-forking server) and its child runs a step of its
    own; the parent is killed: the child, alive, does not keep the parent's lease, which a
    retry takes over within its lock timeout, and keeps its own."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), database_url, scope, driver.kind, "fork"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    forked = int(child.stdout.readline())  # it holds its own lease by now
    try:
        child.kill()
        child.wait(60)
        assert child.returncode == -9
        taken_over_after_death(driver, scope)
        os.kill(forked, 0)  # alive all along
        own = f"{scope}-fork"
        sent_at = sends(driver.engine.db, own)[0].sent_at
        until(
            lambda: key_row(driver.engine.db, own).locked_at > sent_at + timedelta(seconds=LEASE),
            "the child to renew its own lease past its lock timeout",
        )
    finally:
        child.communicate(timeout=60)  # closes stdin: the forked child exits


def refused_for_three_leases(other: rp.Engine, op: rp.Operation[Any], scope: str) -> None:
    """Retries of key ``k`` in ``scope`` from ``other`` are refused for three lock timeouts
    on the database's clock."""
    began = key_row(other.db, scope).db_now
    while key_row(other.db, scope).db_now - began < timedelta(seconds=3 * LEASE):
        with pytest.raises(rp.KeyInUse):
            other.run(op, key="k", params={"scope": scope}, scope=scope)
        time.sleep(POLL)


@pytest.mark.slow
def test_an_async_step_blocking_its_loop_keeps_its_key(database_url: str, scope: str) -> None:
    """An ``async def`` step making a sync call blocks its event loop for three lock
    timeouts: its renewals, from the heartbeat's thread, go on. A retry from another
    engine meanwhile is refused each time; the provider is called once."""
    engine, other = rp.AsyncEngine(database_url), rp.Engine(database_url)
    driver = Driver("async", engine)
    try:
        with other.db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        mailer, retry_mailer = Mailer(other.db), Mailer(other.db)
        retry_mailer.gate.set()
        op: rp.Operation[Any] = rp.Operation("notify", lock_timeout=timedelta(seconds=LEASE))

        @op.atomic_phase("begun")
        async def begin(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> None:
            return None

        @op.foreign_step("sent")
        async def send(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
            return mailer.send(step, params["scope"])  # blocks the loop

        @op.atomic_phase("done")
        async def done(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> rp.Response:
            return rp.Response(201, dict(tx.state))

        engine.register(op)
        retry_op = operation("sync", retry_mailer)
        other.register(retry_op)
        first = driver.start(op, scope)
        assert mailer.calling.wait(60)
        refused_for_three_leases(other, retry_op, scope)
        mailer.gate.set()
        outcome = first.result(60)
        assert outcome.status == 201 and outcome.body == {"lost": False}
        assert len(sends(other.db, scope)) == 1
        assert retry_mailer.steps == []
    finally:
        mailer.gate.set()
        driver.close()
        other.dispose()


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.slow
def test_a_step_keeps_its_key_while_the_pool_is_busy(
    kind: str, database_url: str, scope: str
) -> None:
    """The renewals need nothing of the engine's pool: its only connection, taken by the
    application for three lock timeouts while a step runs, holds none back. A retry from
    another engine meanwhile is refused each time; the provider is called once."""
    engine: rp.Engine | rp.AsyncEngine
    if kind == "sync":
        engine = rp.Engine(sa.create_engine(database_url, pool_size=1, max_overflow=0))
        pool = engine.db
    else:
        engine = rp.AsyncEngine(create_async_engine(database_url, pool_size=1, max_overflow=0))
        pool = engine.async_db.sync_engine
    other = rp.Engine(database_url)
    driver = Driver(kind, engine)
    release = threading.Event()
    try:
        with other.db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        mailer, retry_mailer = Mailer(other.db), Mailer(other.db)
        retry_mailer.gate.set()
        op, retry_op = operation(kind, mailer), operation("sync", retry_mailer)
        engine.register(op)
        other.register(retry_op)
        first = driver.start(op, scope)
        assert mailer.calling.wait(60)
        taken = threading.Event()

        async def take_async() -> None:
            async with engine.async_db.connect():  # type: ignore[union-attr]
                taken.set()
                await asyncio.to_thread(release.wait, 120)

        def take() -> None:
            with pool.connect():
                taken.set()
                release.wait(120)

        busy = driver.submit(take_async) if kind == "async" else driver.submit(take)
        assert taken.wait(60)
        assert pool.pool.checkedout() == 1  # type: ignore[attr-defined]
        refused_for_three_leases(other, retry_op, scope)
        release.set()
        busy.result(60)
        mailer.gate.set()
        outcome = first.result(60)
        assert outcome.status == 201 and outcome.body == {"lost": False}
        assert len(sends(other.db, scope)) == 1
        assert retry_mailer.steps == []
    finally:
        release.set()
        mailer.gate.set()
        if isinstance(engine, rp.AsyncEngine):
            driver.submit(engine.async_db.dispose).result(60)
        else:
            engine.db.dispose()
        driver.close()
        other.dispose()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


class Freezer:
    """A TCP proxy to the database that forwards until :meth:`freeze`, then forwards
    nothing more while keeping every socket open: a half-open connection, which neither
    keepalives (the proxy's kernel answers them) nor any timeout of the server ends."""

    def __init__(self, url: sa.URL) -> None:
        # A server reached by its socket directory (the embedded one) is proxied there.
        directory = url.query.get("host") if url.host is None else None
        self.target: tuple[str, int] | str = (
            f"{directory}/.s.PGSQL.{url.port or 5432}"
            if isinstance(directory, str)
            else (url.host or "127.0.0.1", url.port or 5432)
        )
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = url.difference_update_query(["host"]).set(
            host="127.0.0.1", port=self.listener.getsockname()[1]
        )
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _connect(self) -> socket.socket:
        if isinstance(self.target, str):
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.target)
            return server
        return socket.create_connection(self.target)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = self._connect()
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.frozen.is_set():
                    return  # swallowed, and nothing read or sent again
                sink.sendall(data)
        except OSError:
            return

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.mark.slow
def test_a_renewal_stuck_on_a_half_open_socket_is_left_behind(
    driver: Driver,
    scope: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The heartbeat's connection goes silent mid-renewal: after an interval the renewal
    is left behind with its connection, and the lease is renewed on a fresh one. Retries
    for three lock timeouts are refused; the provider is called once."""
    db = driver.engine.db
    url = db.url
    freezer = Freezer(url)
    connects: list[float] = []
    connect = heartbeat._Link._connect

    def first_through_the_freezer(link: Any, timeout: float) -> Any:
        connects.append(timeout)
        if len(connects) == 1:
            link._db = sa.create_engine(freezer.url)
        return connect(link, timeout)

    monkeypatch.setattr(heartbeat._Link, "_connect", first_through_the_freezer)
    mailer = Mailer(db)
    op = operation(driver.kind, mailer)
    driver.engine.register(op)
    first = driver.start(op, scope)
    try:
        assert mailer.calling.wait(60)
        began = key_row(db, scope).locked_at
        until(lambda: key_row(db, scope).locked_at > began, "a renewal through the proxy")
        freezer.freeze()
        frozen_at = key_row(db, scope).db_now
        while key_row(db, scope).db_now - frozen_at < timedelta(seconds=3 * LEASE):
            with pytest.raises(rp.KeyInUse):
                driver.run(op, scope)
            time.sleep(POLL)
    finally:
        mailer.gate.set()
        freezer.close()
    outcome = first.result(60)
    assert outcome.status == 201 and outcome.body == {"lost": False}
    assert len(sends(db, scope)) == 1
    assert len(connects) >= 2
    assert "no answer within" in caplog.text
