"""What only rp.AsyncEngine can be asked, beside the guarantees both engines share
(tests/test_engine_async.py, from which tests/test_engine_sync.py is generated): the sync
and async engines each refuse the other kind of phase, and a request cancelled wherever it
is (a timeout, a client gone) leaves no lease and no transaction behind."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
import test_engine_async

# asyncio.timeout's cancellation of the awaiting task itself, on Pythons before 3.11 too.
from anyio import fail_after
from rides import count
from test_engine_async import APPLICATION, Gate, key_row

import recoverypoint as rp
from recoverypoint.engine import _libpq_async

pytestmark = pytest.mark.anyio

# The fixtures both engine suites use (tests/test_engine_async.py): the engine, the
# operation it runs, and the gate its phases stop at.
engine, op, gate = test_engine_async.engine, test_engine_async.op, test_engine_async.gate


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- sync and async do not mix --------------------------------------------------------


def test_the_async_engine_refuses_plain_phases(database_url: str) -> None:
    op: rp.Operation[Any] = rp.Operation("plain")

    @op.atomic_phase("finished")
    def plain(tx: Any, params: Any) -> None: ...

    engine = rp.AsyncEngine(database_url)
    with pytest.raises(rp.DeclarationError, match="async def"):
        engine.register(op)
    assert engine.operations == ()
    asyncio.run(engine.dispose())


def test_the_sync_engine_refuses_async_phases(db: sa.Engine) -> None:
    op: rp.Operation[Any] = rp.Operation("coroutines")

    @op.foreign_step("called")
    async def step(step: Any, params: Any) -> None: ...

    @op.atomic_phase("finished")
    def finish(tx: Any, params: Any) -> None: ...

    with pytest.raises(rp.DeclarationError, match=r"rp\.AsyncEngine"):
        rp.Engine(db).register(op)


# -- cancellation ---------------------------------------------------------------------


def activity(db: sa.Engine) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT pid, state, query FROM pg_stat_activity "
                    "WHERE datname = current_database()"
                )
            )
        )


async def open_transactions(db: sa.Engine) -> int:
    """The engine's connections that are in a transaction, once the backends of those
    it closed in the middle of a statement have ended theirs: the server does when it
    sees the socket close, a moment later (waited for up to 60 s: a busy machine may be
    slow to get there). A connection handed back to the pool inside a transaction stays,
    and is counted."""
    deadline = time.monotonic() + 60
    while True:
        left = count(
            db,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = :a AND state LIKE 'idle in transaction%'",
            a=APPLICATION,
        )
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.02)


class CancelAtStatement:
    """Cancels the running task while its ``n``-th statement (or COMMIT) is on the wire."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.fired = False

    def arm(self) -> None:
        self.seen += 1
        if self.seen == self.n:
            task = asyncio.current_task()
            assert task is not None
            self.fired = True
            asyncio.get_running_loop().call_soon(task.cancel)


@pytest.fixture
def cancel_points(monkeypatch: pytest.MonkeyPatch) -> list[CancelAtStatement]:
    """Every statement and COMMIT the request path sends calls the armed cancellers."""
    armed: list[CancelAtStatement] = []
    execute, commit = psycopg.AsyncCursor.execute, psycopg.AsyncConnection.commit

    async def cancelling_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        for canceller in armed:
            canceller.arm()
        return await execute(self, *args, **kwargs)

    async def cancelling_commit(self: Any) -> None:
        for canceller in armed:
            canceller.arm()
        await commit(self)

    def cancelling(send: Any) -> Any:
        async def sending(*args: Any, **kwargs: Any) -> Any:
            for canceller in armed:
                canceller.arm()
            return await send(*args, **kwargs)

        return sending

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", cancelling_execute)
    monkeypatch.setattr(psycopg.AsyncConnection, "commit", cancelling_commit)
    # The engine's own statements, on libpq.
    monkeypatch.setattr(_libpq_async, "execute", cancelling(_libpq_async.execute))
    monkeypatch.setattr(_libpq_async, "command", cancelling(_libpq_async.command))
    return armed


async def test_cancellation_at_every_await_leaves_no_lease_and_no_transaction(
    engine: rp.AsyncEngine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    cancel_points: list[CancelAtStatement],
) -> None:
    n = 0
    while True:
        n += 1
        key = f"k{n}"
        canceller = CancelAtStatement(n)
        cancel_points[:] = [canceller]
        task = asyncio.create_task(engine.run(op, key=key, scope=scope, params={"scope": scope}))
        try:
            outcome = await task
        except asyncio.CancelledError:
            outcome = None
        cancel_points.clear()
        if not canceller.fired:
            assert outcome is not None and outcome.status == 201
            break
        assert n < 60, "the request path sends more statements than expected"
        assert engine.async_db.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert await open_transactions(db) == 0, (n, activity(db))
        with db.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT id, recovery_point, lock_token, attempts FROM idempotency_keys "
                    "WHERE scope = :s AND idempotency_key = :k"
                ),
                {"s": scope, "k": key},
            ).one_or_none()
        if outcome is None and row is not None:
            # Cancelled: unless the response committed first, the lease is given up and
            # the attempt counted, and a retry finishes the request once.
            if row.recovery_point != "finished":
                assert row.lock_token is None and row.attempts == 1
            again = await engine.run(op, key=key, scope=scope, params={"scope": scope})
            assert again.status == 201
        rides = count(
            db,
            "SELECT count(*) FROM rides r JOIN idempotency_keys k ON k.id = r.key_id "
            "WHERE k.scope = :s AND k.idempotency_key = :k",
            s=scope,
            k=key,
        )
        assert rides == (0 if row is None else 1)
    assert n > 8  # every statement of a fresh request was a cancellation point


async def test_cancelling_a_resume_at_every_await_leaves_no_lease(
    engine: rp.AsyncEngine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    gate: Gate,
    cancel_points: list[CancelAtStatement],
) -> None:
    async def boom() -> None:
        raise rp.Retryable("the last phase fails once")

    gate.hooks["finished:start"] = boom
    with pytest.raises(rp.Retryable):
        await engine.run(op, key="k", scope=scope, params={"scope": scope})
    gate.hooks.clear()
    key_id = key_row(db, scope).id
    n = 0
    while True:
        n += 1
        canceller = CancelAtStatement(n)
        cancel_points[:] = [canceller]
        task = asyncio.create_task(engine.resume(key_id))
        try:
            outcome = await task
        except asyncio.CancelledError:
            outcome = None
        cancel_points.clear()
        if not canceller.fired:
            assert outcome is not None and outcome.status == 201
            break
        assert n < 40, "resume sends more statements than expected"
        assert engine.async_db.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert await open_transactions(db) == 0, (n, activity(db))
        row = key_row(db, scope)
        if row.recovery_point != "finished":
            assert row.lock_token is None, n  # the lease is given up, the claim's too
    assert n > 3  # the claim's statement and COMMIT were cancellation points
    assert key_row(db, scope).recovery_point == "finished"
    rides = count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope)
    assert rides == 1


async def test_a_timeout_inside_a_phase_releases_the_lease(
    engine: rp.AsyncEngine, op: rp.Operation[Any], db: sa.Engine, scope: str, gate: Gate
) -> None:
    async def slow_statement() -> None:
        gate.hooks.clear()
        await asyncio.sleep(10)

    gate.hooks["finished:start"] = slow_statement
    with pytest.raises(TimeoutError):
        with fail_after(0.5):
            await engine.run(op, key="k", scope=scope, params={"scope": scope})
    row = key_row(db, scope)
    assert row.recovery_point == "charge_created"
    assert row.lock_token is None and row.attempts == 1 and "CancelledError" in row.last_error
    assert await open_transactions(db) == 0
    assert (await engine.resume(row.id)).status == 201


async def test_a_server_side_statement_is_cancelled_with_the_task(
    engine: rp.AsyncEngine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation(f"sleepy_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    async def sleepy(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> None:
        await tx.execute("SELECT pg_sleep(30)")

    engine.register(op)
    # asyncio's own TimeoutError before Python 3.11, the builtin after.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.run(op, key="k", scope=scope, params={}), 0.5)
    # A new key whose first phase was cancelled leaves nothing behind.
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0
    assert await open_transactions(db) == 0
    assert (
        count(
            db,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = 'SELECT pg_sleep(30)' AND state = 'active'",
        )
        == 0
    )
