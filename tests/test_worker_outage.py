"""A worker's loop outlives the passes that fail: the database goes away for a moment (every
connection killed, new ones refused), each pass meanwhile fails and is logged, and once the
database is back the completer completes and the enqueuer publishes as before."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from workload import JOB, Recorder, plant_keys, rows, stage_jobs, steps_operation, wait_for

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.jobs import InProcessBackend
from recoverypoint.workers import Completer, Enqueuer, Worker


@contextmanager
def database_down(server_url: str, database_url: str) -> Iterator[None]:
    """While inside, ``database_url``'s database refuses connections, and every
    connection it had was killed on the way in."""
    name = sa.make_url(database_url).database
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ),
                {"n": name},
            )
        yield
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.dispose()


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
    ]
    threads = [
        threading.Thread(target=w.run_forever, kwargs={"interval": 0.05}, daemon=True)
        for w in workers
    ]

    def errors(worker: str) -> int:
        return sum(f"event=error worker={worker} " in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="recoverypoint.workers")
    try:
        for thread in threads:
            thread.start()
        with database_down(server_url, worker_database_url):
            # Each worker's passes fail (its pooled connections were killed, new ones are
            # refused), and its loop goes on.
            wait_for(
                lambda: (
                    (errors("completer") >= 2 and errors("enqueuer") >= 2)
                    or not all(thread.is_alive() for thread in threads)
                )
            )
            assert all(thread.is_alive() for thread in threads)
        worker_db.dispose()  # the test's own pooled connections died too

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
    assert len(stopped) == 2
