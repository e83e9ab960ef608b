"""Jobs staged in any atomic phase, not only the last: each is staged once, in the
transaction of its phase (one that failed stages nothing), and the enqueuer publishes
each once."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from workload import Recorder, rows

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend
from recoverypoint.workers import Enqueuer


class Boom(Exception):
    pass


def staging_operation(fail_once: set[str]) -> rp.Operation[Any]:
    """Every atomic phase stages jobs: the first one (in the claim's transaction, followed
    by a foreign step), the one after the step (in the transaction that also commits the
    step's result), one between two atomic phases, and the last. A phase named in
    ``fail_once`` raises once, after staging its job."""
    op: rp.Operation[Any] = rp.Operation("staging")

    def stage(tx: rp.AtomicContext, phase: str, count: int = 1) -> None:
        for n in range(count):
            tx.stage_job("notify", {"phase": phase, "n": n})
        if phase in fail_once:
            fail_once.discard(phase)
            raise Boom(phase)

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: Any) -> None:
        stage(tx, "reserved", count=2)

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {"charge": step.downstream_key()}

    @op.atomic_phase("recorded")
    def record(tx: rp.AtomicContext, params: Any) -> None:
        stage(tx, "recorded")

    @op.atomic_phase("noted")
    def note(tx: rp.AtomicContext, params: Any) -> None:
        stage(tx, "noted")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        stage(tx, "finished")
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


EXPECTED = [("finished", 0), ("noted", 0), ("recorded", 0), ("reserved", 0), ("reserved", 1)]


def staged(db: sa.Engine) -> list[Any]:
    return rows(
        db,
        "SELECT job_args->>'phase' AS phase, (job_args->>'n')::int AS n, job_key, "
        "idempotency_key_id FROM staged_jobs ORDER BY 1, 2",
    )


@pytest.mark.parametrize("fail_once", [set(), {"noted"}, {"recorded"}], ids=str)
@pytest.mark.slow
def test_jobs_of_every_phase_are_staged_and_published_once(
    worker_db: sa.Engine, fail_once: set[str]
) -> None:
    recorder = Recorder(worker_db)
    engine = rp.Engine(worker_db, jobs=InProcessBackend({"notify": recorder.published}))
    op = staging_operation(set(fail_once))
    engine.register(op)

    if fail_once:
        # The failed phase rolled back with its jobs; the retry stages them again, once.
        with pytest.raises(Boom):
            engine.run(op, key="k", params={})
    outcome = engine.run(op, key="k", params={})

    assert outcome.status == 201 and not outcome.replayed
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
    jobs = staged(worker_db)
    assert [(j.phase, j.n) for j in jobs] == EXPECTED
    assert {j.idempotency_key_id for j in jobs} == {key_id}
    job_keys = sorted(j.job_key for j in jobs)
    assert len(set(job_keys)) == len(EXPECTED)

    result = Enqueuer(engine).run_once()

    assert (result.published, result.failed) == (len(EXPECTED), 0)
    assert rows(worker_db, "SELECT * FROM staged_jobs") == []
    published = sorted(r.job_key for r in rows(worker_db, "SELECT job_key FROM published"))
    assert published == job_keys
    assert not Enqueuer(engine).run_once()
