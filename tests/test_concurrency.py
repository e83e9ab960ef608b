"""Races on real PostgreSQL: one key, many callers; lease takeover; contended rows."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from rides import Faults, Provider, count, ride_operation

import recoverypoint as rp
from recoverypoint import admin

RIDES = rp.Request("POST", "/rides")


@pytest.mark.slow
def test_fifty_threads_racing_one_key_run_each_phase_once(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)
    # Widen the window in which the others arrive while the key is in flight.
    faults.hooks["charge_created:before_call"] = lambda: time.sleep(0.2)
    start = threading.Barrier(50)

    def call(_: int) -> rp.Outcome | rp.KeyInUse:
        start.wait()
        try:
            return engine.run(op, key="race", params={"scope": scope}, scope=scope, request=RIDES)
        except rp.KeyInUse as exc:
            return exc

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(call, range(50)))

    fresh = [r for r in results if isinstance(r, rp.Outcome) and not r.replayed]
    replays = [r for r in results if isinstance(r, rp.Outcome) and r.replayed]
    in_use = [r for r in results if isinstance(r, rp.KeyInUse)]
    assert len(fresh) == 1
    assert len(replays) + len(in_use) == 49
    assert all(r.body == fresh[0].body for r in replays)
    assert faults.calls["ride_created:start"] == 1
    assert faults.calls["charge_created:before_call"] == 1
    assert faults.calls["finished:start"] == 1
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1


def test_lease_takeover_fences_the_old_owner(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    """A's lease is released by an operator's force while its foreign step runs (a live
    holder keeps it otherwise); B takes the key over and finishes it; A's commit then fails
    with LockLost and writes nothing; the charge happens once."""
    op = ride_operation("create_ride", provider, faults, lock_timeout=timedelta(seconds=1))
    engine.register(op)
    a_in_step, b_done = threading.Event(), threading.Event()
    slow_once = {"A": True}

    def a_outlives_its_lease() -> None:
        if slow_once.pop("A", False):
            a_in_step.set()
            assert b_done.wait(10)

    faults.hooks["charge_created:after_call"] = a_outlives_its_lease
    params = {"scope": scope}
    a_result: list[BaseException] = []

    def run_a() -> None:
        try:
            engine.run(op, key="k", params=params, scope=scope, request=RIDES)
        except BaseException as exc:
            a_result.append(exc)

    a = threading.Thread(target=run_a)
    a.start()
    assert a_in_step.wait(10)
    with pytest.raises(rp.KeyInUse):  # A's lease is still fresh
        engine.run(op, key="k", params=params, scope=scope, request=RIDES)
    with db.connect() as conn:
        key_id = conn.execute(
            sa.text("SELECT id FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        ).scalar_one()
    assert admin.release(admin.Admin.for_engine(engine), key_id, force=True).changed == (key_id,)
    b = engine.run(op, key="k", params=params, scope=scope, request=RIDES)
    b_done.set()
    a.join()

    assert b.status == 201 and not b.replayed
    assert len(a_result) == 1 and isinstance(a_result[0], rp.LockLost)
    assert a_result[0].http_status == 409
    with db.connect() as conn:
        row = conn.execute(
            sa.text("SELECT recovery_point, state FROM idempotency_keys WHERE scope = :s"),
            {"s": scope},
        ).one()
    assert row.recovery_point == "finished"
    assert row.state == b.body
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    charged_rides = "SELECT count(*) FROM rides WHERE scope = :s AND charge_id IS NOT NULL"
    assert count(db, charged_rides, s=scope) == 1
    assert engine.run(op, key="k", params=params, scope=scope, request=RIDES).replayed


@pytest.mark.slow
def test_atomic_phase_outliving_its_lease_is_not_taken_over_mid_phase(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    """A is slow inside an atomic phase, past its lease; B's retry waits for A's commit
    instead of taking over mid-phase, then replays A's response. The phase runs once."""
    op: rp.Operation[Any] = rp.Operation("slow_phase", lock_timeout=timedelta(seconds=1))
    a_in_phase = threading.Event()
    runs: list[int] = []

    @op.atomic_phase("started_work")
    def begin(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        runs.append(1)
        tx.connection.execute(
            sa.text("INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'x', :k)"),
            {"s": scope, "k": tx.key_id},
        )
        a_in_phase.set()
        # A stays in the phase until B waits for it, on the key row the phase holds; the
        # bound only turns a hang into a failure.
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE :a = ANY(pg_blocking_pids(pid))"
        a_pid = tx.scalar("SELECT pg_backend_pid()")
        for _ in range(6000):
            if count(db, waiting, a=a_pid):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("B never waited for A's phase")
        return rp.Response(200, {"ok": True})

    engine.register(op)
    a_outcome: list[rp.Outcome] = []
    a = threading.Thread(
        target=lambda: a_outcome.append(engine.run(op, key="k", params={}, scope=scope))
    )
    a.start()
    assert a_in_phase.wait(10)
    # The lease runs out in the phase: no write of the key row can come in to backdate it
    # (the phase holds it, from just after the commit that renewed the lease).
    time.sleep(1.2)
    b = engine.run(op, key="k", params={}, scope=scope)
    a.join(60)
    assert not a.is_alive(), "A's phase never ended"

    assert a_outcome[0].status == 200 and not a_outcome[0].replayed
    assert b.replayed and b.body == {"ok": True}
    assert runs == [1]
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1


@pytest.mark.slow
def test_contended_business_row_all_requests_succeed(
    db: sa.Engine, business_tables: None, scope: str
) -> None:
    """Read-modify-write on one row from 16 requests at once: serialization failures are
    retried in-process and every request succeeds exactly once.

    A request fails only when another commits the row after its snapshot, and each other
    request commits once: 15 retries always suffice, however the machine schedules the
    threads (the default 10 do on most, not on a busy one)."""
    engine = rp.Engine(db, serialization_retries=15)
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO counters (name, n) VALUES (:s, 0)"), {"s": scope})
    invocations: list[int] = []
    op: rp.Operation[Any] = rp.Operation("increment")

    @op.atomic_phase("finished")
    def increment(tx: rp.AtomicContext, params: Any) -> rp.Response:
        invocations.append(params["i"])
        n = tx.connection.execute(
            sa.text("SELECT n FROM counters WHERE name = :s"), {"s": scope}
        ).scalar_one()
        time.sleep(0.01)  # hold the snapshot so transactions overlap
        tx.connection.execute(
            sa.text("UPDATE counters SET n = :n WHERE name = :s"), {"n": n + 1, "s": scope}
        )
        return rp.Response(200, {"n": n + 1})

    engine.register(op)
    start = threading.Barrier(16)

    def call(i: int) -> rp.Outcome:
        start.wait()
        return engine.run(op, key=f"k{i}", params={"i": i}, scope=scope)

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(call, range(16)))

    assert sorted(o.body["n"] for o in outcomes) == list(range(1, 17))
    assert count(db, "SELECT n FROM counters WHERE name = :s", s=scope) == 16
    assert len(invocations) > 16  # conflicts happened and were retried


def test_serialization_failures_beyond_the_retry_budget_surface_as_409(
    db: sa.Engine, business_tables: None, scope: str
) -> None:
    engine = rp.Engine(db, serialization_retries=2)
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO counters (name, n) VALUES (:s, 0)"), {"s": scope})
    attempts: list[int] = []
    op: rp.Operation[Any] = rp.Operation("always_conflicts")

    @op.atomic_phase("finished")
    def conflict(tx: rp.AtomicContext, params: Any) -> rp.Response:
        attempts.append(1)
        tx.connection.execute(sa.text("SELECT n FROM counters WHERE name = :s"), {"s": scope})
        with db.begin() as other:  # a concurrent writer commits first, every time
            other.execute(sa.text("UPDATE counters SET n = n + 1 WHERE name = :s"), {"s": scope})
        tx.connection.execute(
            sa.text("UPDATE counters SET n = 0 WHERE name = :s"), {"s": scope}
        )
        return rp.Response(200)

    engine.register(op)
    with pytest.raises(rp.ConcurrentUpdate) as caught:
        engine.run(op, key="k", params={}, scope=scope)

    assert caught.value.http_status == 409
    assert len(attempts) == 3
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0
