"""No worker waits for a row another transaction holds: it skips it and does the rest
(``FOR UPDATE SKIP LOCKED``), so instances never queue behind each other or a client."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from workload import JOB, Recorder, plant_keys, rows, stage_jobs, steps_operation

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend
from recoverypoint.workers import Completer, Enqueuer, Reaper

OLD = "now() - interval '100 days'"


@dataclass
class Case:
    table: str
    ids: list[int]
    run_once: Callable[[], Any]
    done: str
    """The result's count of rows handled."""
    pending: str
    """SQL: ids of the rows not handled yet."""


def completer(db: sa.Engine) -> Case:
    engine = rp.Engine(db)
    engine.register(steps_operation("steps", Recorder(db)))
    ids = plant_keys(db, "steps", 3, last_run_at=OLD)
    pending = "SELECT id FROM idempotency_keys WHERE finished_at IS NULL"
    return Case("idempotency_keys", ids, Completer(engine, min_age=0).run_once, "finished", pending)


def enqueuer(db: sa.Engine) -> Case:
    stage_jobs(db, 3)
    ids = [r.id for r in rows(db, "SELECT id FROM staged_jobs ORDER BY id")]
    engine = rp.Engine(db, jobs=InProcessBackend({JOB: Recorder(db).published}))
    return Case(
        "staged_jobs", ids, Enqueuer(engine).run_once, "published", "SELECT id FROM staged_jobs"
    )


def reaper(db: sa.Engine) -> Case:
    ids = plant_keys(db, "steps", 3, point="finished", response_status="200", finished_at=OLD)
    run_once = Reaper(rp.Engine(db)).run_once
    return Case("idempotency_keys", ids, run_once, "finished", "SELECT id FROM idempotency_keys")


@pytest.mark.parametrize("setup", [completer, enqueuer, reaper], ids=lambda f: f.__name__)
def test_a_worker_skips_a_locked_row_and_does_the_rest(
    worker_db: sa.Engine, setup: Callable[[sa.Engine], Case]
) -> None:
    case = setup(worker_db)
    pool = ThreadPoolExecutor(1)
    holder = worker_db.connect()
    try:
        # Another instance, or a client, in the middle of its transaction on the first row.
        lock = f"SELECT 1 FROM {case.table} WHERE id = :i FOR UPDATE"
        holder.execute(sa.text(lock), {"i": case.ids[0]})
        # A worker that waited for the lock would not be back before the rollback.
        result = pool.submit(case.run_once).result(timeout=10)
    finally:
        holder.rollback()
        holder.close()
        pool.shutdown()

    assert getattr(result, case.done) == 2
    assert [r.id for r in rows(worker_db, case.pending)] == case.ids[:1]
