"""The enqueuer: every staged job published, exactly the published ones deleted, failed
publishes kept and retried, and three enqueuer processes, one of them killed mid-batch."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from workload import JOB, Recorder, rows, stage_jobs, wait_for

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend, Job
from recoverypoint.testing import InjectedFault, faults
from recoverypoint.workers import Enqueuer, loop

TESTS = Path(__file__).resolve().parent


def test_a_failed_publish_stays_staged_backs_off_and_is_retried(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    keys = stage_jobs(worker_db, 10)
    recorder = Recorder(worker_db)
    broker_down = [True]

    def publish(job: Job) -> None:
        if job.args["n"] == 5 and broker_down:  # the 5th job, mid-batch
            raise ConnectionError("broker went away")
        recorder.published(job)

    engine = rp.Engine(worker_db, jobs=InProcessBackend({JOB: publish}))
    enqueuer = Enqueuer(engine, batch_size=4, retry_base=10.0)

    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        result = enqueuer.run_once()

    assert (result.published, result.failed, result.batches) == (9, 1, 3)
    # One line for the batch, on the first failure of it.
    [line] = [r.getMessage() for r in caplog.records if "event=publish_failed" in r.getMessage()]
    [failed] = rows(worker_db, "SELECT id, job_key FROM staged_jobs")
    assert f"worker=enqueuer failed=1 job_id={failed.id} job_name={JOB} " in line
    assert f" job_key={failed.job_key} attempts=1 retry_in=" in line
    assert line.endswith(' error="ConnectionError: broker went away"')
    [left] = rows(
        worker_db,
        "SELECT job_args, attempts, last_error, next_attempt_at - now() AS due_in FROM staged_jobs",
    )
    assert left.job_args == {"n": 5}
    assert (left.attempts, left.last_error) == (1, "ConnectionError: broker went away")
    assert timedelta(seconds=4) < left.due_in <= timedelta(seconds=10)
    assert not enqueuer.run_once()  # backing off

    broker_down.clear()
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE staged_jobs SET next_attempt_at = now()"))
    assert enqueuer.run_once().published == 1
    assert rows(worker_db, "SELECT * FROM staged_jobs") == []
    published = [r.job_key for r in rows(worker_db, "SELECT job_key FROM published")]
    assert sorted(published) == keys


def test_the_backoff_of_a_job_never_exceeds_the_retry_cap(worker_db: sa.Engine) -> None:
    stage_jobs(worker_db, 1)

    def broker_down(job: Job) -> None:
        raise ConnectionError("broker went away")

    engine = rp.Engine(worker_db, jobs=InProcessBackend({JOB: broker_down}))
    enqueuer = Enqueuer(engine, retry_base=1.0, retry_cap=5.0)
    due_now = "UPDATE staged_jobs SET next_attempt_at = now()"
    job = "SELECT attempts, next_attempt_at - now() AS due_in FROM staged_jobs"

    waits = []
    for attempt in range(1, 7):
        with worker_db.begin() as conn:
            conn.execute(sa.text(due_now))
        assert enqueuer.run_once().failed == 1
        [row] = rows(worker_db, job)
        assert row.attempts == attempt
        waits.append(row.due_in)
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE staged_jobs SET attempts = 80, next_attempt_at = now()"))
    assert enqueuer.run_once().failed == 1
    [row] = rows(worker_db, job)
    waits.append(row.due_in)

    assert timedelta(seconds=0.4) < waits[0] <= timedelta(seconds=1)  # from retry_base
    assert all(timedelta(seconds=2.4) < wait <= timedelta(seconds=5) for wait in waits[3:])


def test_an_enqueuer_needs_a_job_backend(worker_db: sa.Engine) -> None:
    with pytest.raises(ValueError, match="no job backend"):
        Enqueuer(rp.Engine(worker_db))


@pytest.mark.slow
def test_three_enqueuer_processes_publish_10000_jobs_and_a_sigkill_loses_none(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    keys = stage_jobs(worker_db, 10_000)
    env = {**os.environ, "RP_WORKER_TEST_DATABASE_URL": worker_database_url}
    command = [
        sys.executable, "-m", "recoverypoint", "worker", "enqueuer", "--app", "worker_app:engine",
        "--interval", "0.2", "--batch-size", "100",
    ]  # fmt: skip

    def start(**extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            command, cwd=TESTS, env={**env, **extra}, stderr=subprocess.PIPE, text=True
        )

    # The victim publishes slowly (100 jobs take 2 s), so it is surely caught mid-batch.
    victim = start(RP_WORKER_TEST_PUBLISH_DELAY="0.02")
    survivors = [start(), start()]
    try:
        # Mid-batch: jobs it published whose rows its open transaction has not deleted.
        in_flight = (
            "SELECT count(*) FROM published JOIN staged_jobs USING (job_key) WHERE pid = :pid"
        )
        wait_for(lambda: rows(worker_db, in_flight, pid=victim.pid)[0][0] >= 5)
        victim.kill()
        victim.wait(timeout=30)
        wait_for(lambda: rows(worker_db, "SELECT count(*) FROM staged_jobs")[0][0] == 0)
    finally:
        for process in survivors:
            process.send_signal(signal.SIGTERM)
        errors = [process.communicate(timeout=60)[1] for process in survivors]
        if victim.poll() is None:
            victim.kill()
        victim.communicate(timeout=30)

    assert victim.returncode == -signal.SIGKILL
    assert [p.returncode for p in survivors] == [0, 0], errors  # SIGTERM: a clean exit
    counts = rows(
        worker_db,
        "SELECT job_key, count(*) AS times, count(*) FILTER (WHERE pid = :victim) AS by_victim "
        "FROM published GROUP BY job_key",
        victim=victim.pid,
    )
    assert sorted(c.job_key for c in counts) == keys  # every job, none lost
    again = [c for c in counts if c.times > 1]
    # Only jobs of the batch the kill rolled back went out twice (at least once delivery),
    # once by the victim and once by a survivor; the survivors never repeated a job.
    assert 5 <= len(again) <= 100
    assert all((c.times, c.by_victim) == (2, 1) for c in again)


def test_a_fault_between_publish_and_delete_republishes_the_batch(worker_db: sa.Engine) -> None:
    """The after_publish fault point: the batch rolls back, so the jobs it had published
    stay staged and go out again; consumers see them twice, with the same job keys."""
    keys = stage_jobs(worker_db, 3)
    recorder = Recorder(worker_db)
    engine = rp.Engine(worker_db, jobs=InProcessBackend({JOB: recorder.published}))
    enqueuer = Enqueuer(engine, batch_size=10)

    with faults.injected(f"after_publish:{JOB}"), pytest.raises(InjectedFault):
        enqueuer.run_once()
    assert len(rows(worker_db, "SELECT * FROM staged_jobs")) == 3
    assert enqueuer.run_once().published == 3

    assert rows(worker_db, "SELECT * FROM staged_jobs") == []
    published = [r.job_key for r in rows(worker_db, "SELECT job_key FROM published")]
    assert len(published) == 4  # the first job, once before the fault and once after
    assert sorted(set(published)) == keys


@pytest.mark.parametrize("distributed", [False, True], ids=["one server", "by scope"])
def test_jobs_of_every_scope_are_published_however_many_scopes_have_jobs(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch, distributed: bool
) -> None:
    """On one server a batch takes due jobs of every scope: jobs staged in more scopes than
    a pass lists (here 3 a listing) are published in one pass, not a listing's worth of
    scopes per interval. Scope by scope (as on Citus, where each batch names its scope) it
    takes passes, and publishes the same. Either way each job is published with its own
    scope and deleted in it; another scope's job, not due, and a job whose publish failed
    (backed off for a minute), stay."""
    monkeypatch.setattr(loop, "SCOPES_PER_PASS", 3)
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO staged_jobs (scope, job_name, job_args, job_key, next_attempt_at)
                SELECT 's' || s, :job, jsonb_build_object('n', n), 's' || s || '-' || n, now()
                FROM generate_series(1, 10) AS s, generate_series(1, 2) AS n
                UNION ALL  -- another scope's job, due in an hour
                SELECT 'later', :job, '{"n": 1}', 'later-1', now() + interval '1 hour'
                UNION ALL  -- a job whose publish fails
                SELECT 's1', 'broken', '{"n": 3}', 's1-3', now()
                """
            ),
            {"job": JOB},
        )
    published: list[tuple[str | None, str]] = []

    def publish(job: Job) -> None:
        published.append((job.scope, job.job_key))

    def broken(job: Job) -> None:
        raise ConnectionError("no broker for this one")

    engine = rp.Engine(worker_db, jobs=InProcessBackend({JOB: publish, "broken": broken}))
    enqueuer = Enqueuer(engine, batch_size=7, retry_base=60.0)
    enqueuer.distributed = distributed

    passes = [enqueuer.run_once()]
    while distributed and passes[-1].published:
        passes.append(enqueuer.run_once())

    assert len(passes) == (5 if distributed else 1)  # by scope: 3 scopes a pass, then none
    assert sum(p.published for p in passes) == 20
    assert sorted(published) == sorted((f"s{s}", f"s{s}-{n}") for s in range(1, 11) for n in (1, 2))
    left = rows(worker_db, "SELECT scope, job_key, attempts FROM staged_jobs ORDER BY job_key")
    assert [tuple(r) for r in left] == [("later", "later-1", 0), ("s1", "s1-3", 1)]
