"""The guards on the key row's writes, each shown in the situation it is there for:

- a recovery point never moves backwards, even when a foreign step's result is recorded
  after the phase that followed it did commit (its COMMIT reported lost, but done);
- a run that lost its lease writes nothing, even when the row has moved (a stale address)
  and the write falls back to finding the row by id.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from workload import Recorder, rows

import recoverypoint as rp
from recoverypoint import admin


def key_row(db: sa.Engine) -> Any:
    [row] = rows(db, "SELECT xmin::text, k.* FROM idempotency_keys k")
    return row


@pytest.mark.slow
def test_a_step_recorded_after_the_next_phase_committed_does_not_move_the_point_back(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reserved → charged (foreign) → recorded → finished. The COMMIT of `recorded` (which
    also commits the step's result) happens, but the client hears of a lost connection:
    the engine then records the step's result on its own, which must not take the key
    back from `recorded` to `charged`, or the retry would run `recorded` a second time."""
    recorder = Recorder(worker_db)
    op: rp.Operation[Any] = rp.Operation("ambiguous")
    lose_next_commit: list[bool] = []
    first_time = [True]

    def ran(tx: rp.AtomicContext, phase: str) -> None:
        tx.connection.execute(
            sa.text("INSERT INTO phase_runs (key_id, phase, pid) VALUES (:k, :f, 0)"),
            {"k": tx.key_id, "f": phase},
        )
        tx.state[phase] = True

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: Any) -> None:
        ran(tx, "reserved")

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        recorder.step_called(step.key_id)
        return {"charge": step.downstream_key()}

    @op.atomic_phase("recorded")
    def record(tx: rp.AtomicContext, params: Any) -> None:
        ran(tx, "recorded")
        if first_time:
            lose_next_commit.append(first_time.pop())

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran(tx, "finished")
        return rp.Response(201, {"charge": tx.state["charge"]})

    engine = rp.Engine(worker_db)
    engine.register(op)
    commit = worker_db.dialect.do_commit

    def commit_then_lose_the_answer(dbapi_connection: Any) -> None:
        commit(dbapi_connection)
        if lose_next_commit:
            lose_next_commit.clear()
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(worker_db.dialect, "do_commit", commit_then_lose_the_answer)

    with pytest.raises(rp.DatabaseUnavailable) as lost:  # the COMMIT's outcome is unknown
        engine.run(op, key="k", params={})
    assert isinstance(lost.value.__cause__, sa.exc.OperationalError)

    row = key_row(worker_db)
    assert row.recovery_point == "recorded"  # not back at "charged"
    assert row.state == {"reserved": True, "charge": row.state["charge"], "recorded": True}
    assert (row.attempts, row.lock_token) == (1, None)  # the failure was recorded

    outcome = engine.run(op, key="k", params={})

    assert outcome.status == 201 and not outcome.replayed
    runs = rows(worker_db, "SELECT phase, count(*) AS n FROM phase_runs GROUP BY phase")
    assert {r.phase: r.n for r in runs} == {"reserved": 1, "recorded": 1, "finished": 1}
    assert len(rows(worker_db, "SELECT * FROM step_calls")) == 1


@pytest.mark.slow
def test_a_run_that_lost_its_lease_cannot_release_the_new_owners(worker_db: sa.Engine) -> None:
    """An operator releases A's lease by force while A's foreign step runs (a live holder
    keeps its lease otherwise); B takes the key over (the row moves, so A's address of it
    is stale) and is in its own foreign step when A's step fails. A's release, found by id,
    must see that the lease is B's and change nothing. (A lock timeout of a minute: no
    renewal of B's moves the row while the test compares it.)"""
    op: rp.Operation[Any] = rp.Operation("taken_over", lock_timeout=timedelta(seconds=60))
    a_in_step, b_in_step, a_done = threading.Event(), threading.Event(), threading.Event()

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        if threading.current_thread().name == "A":
            a_in_step.set()
            assert b_in_step.wait(10)
            raise ConnectionError("provider down")  # after B took the key over
        b_in_step.set()
        assert a_done.wait(10)
        return {"charge": "ch_1"}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"charge": tx.state["charge"]})

    engine = rp.Engine(worker_db)
    engine.register(op)
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = engine.run(op, key="k", params={})
        except Exception as exc:
            results[name] = exc

    a = threading.Thread(target=run, args=("A",), name="A")
    b = threading.Thread(target=run, args=("B",), name="B")
    a.start()
    assert a_in_step.wait(10)
    released = admin.release(admin.Admin.for_engine(engine), key_row(worker_db).id, force=True)
    assert len(released.changed) == 1
    b.start()
    assert b_in_step.wait(10)
    taken_over = key_row(worker_db)
    a.join(10)

    try:
        assert isinstance(results["A"], ConnectionError)
        # B's lease, and the row, exactly as B's takeover left them.
        assert taken_over.lock_token is not None
        assert key_row(worker_db) == taken_over
    finally:
        a_done.set()
        b.join(10)

    outcome = results["B"]
    assert isinstance(outcome, rp.Outcome) and outcome.status == 201
    row = key_row(worker_db)
    # Two attempts, each counted by its claim: A's, whose lease B took over, and B's. A's
    # failure, fenced out, recorded nothing.
    assert (row.recovery_point, row.attempts, row.last_error) == ("finished", 2, None)


@pytest.mark.slow
@pytest.mark.parametrize("bound", [False, True], ids=["one server", "as on Citus"])
def test_a_phase_that_changes_its_own_key_row_commits_nothing_and_is_told_so(
    worker_db: sa.Engine, bound: bool
) -> None:
    """The write that records the phase misses the row it locked (the phase rewrote the
    lease): it raises (on one server in the same statement, where Citus distributes the keys
    in the one sent instead of its jobs), the COMMIT behind it never runs, and the error
    names the key row, not an ended transaction."""
    op: rp.Operation[Any] = rp.Operation("rewrites_its_key")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "UPDATE idempotency_keys SET lock_token = gen_random_uuid() WHERE id = %(k)s",
            {"k": tx.key_id},
        )
        tx.stage_job("notify", {})
        return rp.Response(201, {})

    engine = rp.Engine(worker_db)
    engine._bound = bound
    engine.register(op)
    with pytest.raises(rp.LockLost, match="the key row changed under the phase"):
        engine.run(op, key="k", params={}, scope="s")
    # The first phase of a new key commits with its claim and its jobs: none did.
    assert rows(worker_db, "SELECT id FROM idempotency_keys") == []
    assert rows(worker_db, "SELECT id FROM staged_jobs") == []
