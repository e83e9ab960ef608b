"""What the worker tests run: a three-phase operation that records every phase body it
runs, a job handler that records every publish, and helpers to plant keys and jobs in any
state with SQL (as a client that gave up, or time, would have left them).

Atomic phase bodies are recorded in their own transaction under a unique constraint, so
a row means "this phase committed" and a second commit of the same phase would fail; the
foreign step is recorded outside any transaction, so every call counts, even one whose
result is later rolled back.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint.jobs import Job
from recoverypoint.keys import canonical_json
from recoverypoint.workers.loop import Worker

SCHEMA = """
CREATE TABLE IF NOT EXISTS phase_runs (
    key_id bigint NOT NULL,
    phase text NOT NULL,
    pid integer NOT NULL,
    UNIQUE (key_id, phase)
);
CREATE TABLE IF NOT EXISTS step_calls (
    key_id bigint NOT NULL,
    pid integer NOT NULL
);
CREATE TABLE IF NOT EXISTS published (
    job_key text NOT NULL,
    pid integer NOT NULL
);
-- The Celery consumer's work, and every delivery it got (celery_app.py).
CREATE TABLE IF NOT EXISTS receipts (
    message_id text NOT NULL,
    key_id bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS deliveries (
    message_id text NOT NULL,
    ran boolean NOT NULL
);
"""

PHASES = ("reserved", "charged", "finished")
JOB = "notify"


class Recorder:
    """Writes on a connection of its own, committed at once, as a foreign system would."""

    def __init__(self, db: sa.Engine, on_step: Callable[[], object] = lambda: None) -> None:
        self.db = db.execution_options(isolation_level="AUTOCOMMIT")
        self.on_step = on_step

    def step_called(self, key_id: int) -> None:
        self._insert("INSERT INTO step_calls (key_id, pid) VALUES (:k, :p)", k=key_id)
        self.on_step()

    def published(self, job: Job) -> None:
        self._insert("INSERT INTO published (job_key, pid) VALUES (:k, :p)", k=job.job_key)

    def _insert(self, sql: str, **params: Any) -> None:
        with self.db.connect() as conn:
            conn.execute(sa.text(sql), {**params, "p": os.getpid()})


def steps_operation(name: str, recorder: Recorder, **options: Any) -> rp.Operation[Any]:
    """reserved (atomic) → charged (foreign) → finished (atomic, stages a job, 201).

    ``params["fail"]`` names a phase that raises every time it runs.
    """
    op: rp.Operation[Any] = rp.Operation(name, **options)

    def ran(tx: rp.AtomicContext, phase: str) -> None:
        tx.connection.execute(
            sa.text("INSERT INTO phase_runs (key_id, phase, pid) VALUES (:k, :f, :p)"),
            {"k": tx.key_id, "f": phase, "p": os.getpid()},
        )

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        ran(tx, "reserved")

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        recorder.step_called(step.key_id)
        if params.get("fail") == "charged":
            raise RuntimeError("card network down")
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        ran(tx, "finished")
        tx.stage_job(JOB, {"key_id": tx.key_id})
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


def async_steps_operation(
    name: str,
    recorder: Recorder,
    *,
    provider_down: Callable[[], bool] = lambda: False,
    gate: Callable[[], Awaitable[None]] | None = None,
    **options: Any,
) -> rp.Operation[Any]:
    """:func:`steps_operation` with ``async def`` phases, for ``rp.AsyncEngine``.

    Its foreign step also fails while ``provider_down()`` holds, and awaits ``gate()``
    first (a test's barrier) when one is given.
    """
    op: rp.Operation[Any] = rp.Operation(name, **options)

    async def ran(tx: rp.AsyncAtomicContext, phase: str) -> None:
        await tx.execute(
            "INSERT INTO phase_runs (key_id, phase, pid) VALUES (%s, %s, %s)",
            (tx.key_id, phase, os.getpid()),
        )

    @op.atomic_phase("reserved")
    async def reserve(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> None:
        await ran(tx, "reserved")

    @op.foreign_step("charged")
    async def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        if gate is not None:
            await gate()
        recorder.step_called(step.key_id)
        if params.get("fail") == "charged" or provider_down():
            raise RuntimeError("card network down")
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> rp.Response:
        await ran(tx, "finished")
        tx.stage_job(JOB, {"key_id": tx.key_id})
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


def plant_keys(
    db: sa.Engine,
    operation: str,
    count: int,
    *,
    version: int = 1,
    point: str = "started",
    params: dict[str, Any] | None = None,
    **columns: str,
) -> list[int]:
    """Insert ``count`` key records as a client that stopped at ``point`` leaves them.

    ``columns`` are SQL expressions for other columns, e.g. ``finished_at="now() - '4
    days'::interval"``. Returns the new ids.
    """
    names = ", ".join(columns)
    values = ", ".join(columns.values())
    with db.begin() as conn:
        ids = conn.execute(
            sa.text(
                f"""
                INSERT INTO idempotency_keys (
                    scope, operation, idempotency_key, operation_version, request_method,
                    request_path, request_params, fingerprint, recovery_point
                    {", " + names if names else ""})
                SELECT 'planted', :operation, :prefix || n, :version, 'POST',
                       '/test', CAST(:params AS jsonb), 'fp', :point
                       {", " + values if values else ""}
                FROM generate_series(1, :count) AS n
                RETURNING id
                """
            ),
            {
                "operation": operation,
                "prefix": uuid.uuid4().hex + "-",
                "version": version,
                "params": canonical_json(params or {}),
                "point": point,
                "count": count,
            },
        ).scalars()
        return sorted(ids)


def stage_jobs(db: sa.Engine, count: int, name: str = JOB) -> list[str]:
    """Stage ``count`` jobs as atomic phases would have; returns their job keys."""
    with db.begin() as conn:
        keys = conn.execute(
            sa.text(
                """
                INSERT INTO staged_jobs (scope, job_name, job_args, job_key)
                SELECT 'jobs', :name, jsonb_build_object('n', n), :prefix || n
                FROM generate_series(1, :count) AS n
                RETURNING job_key
                """
            ),
            {"name": name, "prefix": uuid.uuid4().hex + "-", "count": count},
        ).scalars()
        return sorted(keys)


def rows(db: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(sa.text(sql), params))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a dead process that its adopter has not reaped (a container's
    first process may never reap) is a zombie, state Z."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_for(condition: Callable[[], bool], timeout: float = 600.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds. The bound only
    turns a hang into a failure: a worker process starting on a machine busy with other
    suites may take a minute and more, so it is generous."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s"
        time.sleep(0.05)


def one_recorded_pass(worker: Worker[Any], interval: float = 0.1, jitter: float = 0.0) -> None:
    """Run ``worker.run_forever(interval, jitter)`` for exactly one pass, recorded as every
    pass is (with ``interval + jitter`` as its longest wait), then stop: stopped by the pass
    itself, where a timer could fire before a busy machine began it."""
    one_pass = worker.run_once

    def then_stop() -> Any:
        try:
            return one_pass()
        finally:
            worker.stop()

    worker.run_once = then_stop  # type: ignore[method-assign]
    worker.run_forever(interval, jitter)
