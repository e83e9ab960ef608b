"""A worker's loop outlives the passes that fail: the database goes away for a moment (every
connection killed, new ones refused), each pass meanwhile fails, one line says so when the
outage begins (not one per pass) and another when it ends, and once the database is back
the completer completes, the enqueuer publishes and the reaper reaps as before."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from outages import database_down
from workload import JOB, Recorder, plant_keys, rows, stage_jobs, steps_operation, wait_for

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend
from recoverypoint.workers import Completer, Enqueuer, Reaper, Worker


@pytest.mark.slow
def test_the_completer_and_the_enqueuer_outlive_passes_that_fail(
    server_url: str,
    worker_database_url: str,
    worker_db: sa.Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder(worker_db)
    engine = rp.Engine(worker_database_url, jobs=InProcessBackend({JOB: recorder.published}))
    engine.register(steps_operation("steps", recorder))
    workers: list[Worker[rp.workers.Result]] = [
        Completer(engine, min_age=0),
        Enqueuer(engine),
        Reaper(engine),
    ]
    passes = {w.name: 0 for w in workers}
    for worker in workers:
        run_once = worker.run_once

        def counted(run_once: Any = run_once, name: str = worker.name) -> Any:
            passes[name] += 1
            return run_once()

        worker.run_once = counted  # type: ignore[method-assign]
    threads = [
        threading.Thread(target=w.run_forever, kwargs={"interval": 0.05}, daemon=True)
        for w in workers
    ]

    def lines(event: str, worker: str) -> int:
        return sum(f"event={event} worker={worker} " in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="recoverypoint.workers")
    try:
        for thread in threads:
            thread.start()
        with database_down(server_url, worker_database_url):
            # Each worker's passes fail (its pooled connections were killed, new ones are
            # refused), and its loop goes on: three passes each after the outage began.
            wait_for(lambda: all(lines("database_unavailable", w.name) for w in workers))
            during = dict(passes)
            wait_for(
                lambda: (
                    all(passes[name] >= n + 3 for name, n in during.items())
                    or not all(thread.is_alive() for thread in threads)
                )
            )
            assert all(thread.is_alive() for thread in threads)
        worker_db.dispose()  # the test's own pooled connections died too
        wait_for(lambda: all(lines("database_back", w.name) for w in workers))
        for worker in workers:  # one line for the outage, none per failed pass
            assert lines("database_unavailable", worker.name) == 1
            assert lines("error", worker.name) == 0

        # Work that arrives after the outage is done as usual.
        keys = plant_keys(worker_db, "steps", 3)
        jobs = stage_jobs(worker_db, 4)
        finished = "SELECT count(*) FROM idempotency_keys WHERE response_status = 201"
        wait_for(lambda: rows(worker_db, finished)[0][0] == len(keys))
        # The 4 jobs, and the one each completed key staged.
        wait_for(lambda: rows(worker_db, "SELECT count(*) FROM published")[0][0] == 7)
    finally:
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(30)
        engine.dispose()

    assert not any(thread.is_alive() for thread in threads)
    published = {r.job_key for r in rows(worker_db, "SELECT job_key FROM published")}
    assert published.issuperset(jobs)
    assert rows(worker_db, "SELECT * FROM staged_jobs") == []
    stopped = [r.getMessage() for r in caplog.records if "event=stopped" in r.getMessage()]
    assert len(stopped) == 3
