"""The enqueuer: publishes staged jobs to the engine's job backend, at least once.

Each batch is one transaction: claim due jobs with ``FOR UPDATE SKIP LOCKED``, publish
them one by one, delete exactly the ids that were published, and record the failures; then
commit. The row locks are what keep two enqueuers from publishing the same job, so unlike
the request path (which never holds a transaction across a foreign call) the publishes
happen inside the transaction. Batches are small and a publish is short, so the locks are
held briefly. An enqueuer that dies mid-batch rolls back: its jobs stay staged and are
published again, which consumers absorb with :func:`recoverypoint.jobs.consume_once` on
the ``job_key`` every message carries.

This fixes both defects of the reference drain: it deletes ``WHERE id = ANY(published)``,
never ``id <= max(id)``, and it needs no snapshot trick, because only locked rows are
deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import TextClause, text

from .._faults import faults
from ..backoff import backoff_delay
from ..jobs import Job, JobBackend, UnknownJob
from .engines import AnyEngine
from .loop import EVERY_SCOPE, IN_SCOPE, Result, Rows, Worker, describe

# The scopes with jobs due, those waiting longest first (where the keys are distributed).
_DUE_SCOPES = text(
    """
    SELECT scope FROM staged_jobs WHERE next_attempt_at <= now()
    GROUP BY scope ORDER BY min(next_attempt_at) LIMIT :scopes
    """
)


def _claim_jobs(rows: Rows) -> TextClause:
    """Due jobs, oldest first, of ``:scope`` or of every scope (see :class:`.loop.Rows`).
    Jobs another enqueuer holds are skipped, not waited for."""
    return text(
        f"""
    SELECT id, scope, job_name, job_args, job_key, attempts, trace_context,
           extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
    FROM staged_jobs
    WHERE {rows.only}next_attempt_at <= now()
    ORDER BY next_attempt_at, id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
    """
    )


_CLAIM_IN_SCOPE, _CLAIM_EVERY_SCOPE = _claim_jobs(IN_SCOPE), _claim_jobs(EVERY_SCOPE)

# Exactly the jobs this batch published, all of them locked by this transaction: by their
# ids, an identity unique across scopes, in the batch's scopes. (A join with the pairs
# instead reads the whole table into a hash when the planner thinks it small.)
_DELETE_PUBLISHED = text(
    """
    DELETE FROM staged_jobs
    WHERE id = ANY(CAST(:ids AS bigint[])) AND scope = ANY(CAST(:scopes AS text[]))
    """
)
# The same, in one scope: a statement Citus routes to the scope's shard alone.
_DELETE_PUBLISHED_IN_SCOPE = text(
    "DELETE FROM staged_jobs WHERE scope = :scope AND id = ANY(CAST(:ids AS bigint[]))"
)

# A job whose publish failed stays staged and waits before it is tried again.
_POSTPONE = text(
    """
    UPDATE staged_jobs
    SET attempts = attempts + 1, last_error = :error,
        next_attempt_at = now() + make_interval(secs => :retry_in)
    WHERE scope = :scope AND id = :id
    """
)


@dataclass
class EnqueuerResult(Result):
    published: int = 0
    """Jobs handed to the backend and removed from ``staged_jobs``."""
    failed: int = 0
    """Publishes that failed; those jobs stay staged and back off."""
    unknown: int = 0
    """Jobs the backend has no handler for (:class:`~recoverypoint.jobs.UnknownJob`): an
    error; they stay staged and back off, and ``--once`` fails."""

    @property
    def stranded(self) -> int:
        return self.unknown


class Enqueuer(Worker[EnqueuerResult]):
    """Publishes staged jobs to ``engine.jobs`` (with two engines, the first one set),
    whichever engine's phases staged them.

    Parameters
    ----------
    retry_base:
        Seconds a job whose publish failed first waits, with jitter, before the next try;
        each failure after waits longer.
    retry_cap:
        Seconds: the longest a job waits between two tries.
    """

    name: ClassVar[str] = "enqueuer"
    default_batch_size: ClassVar[int] = 100
    default_interval: ClassVar[float] = 1.0

    def __init__(
        self,
        engine: AnyEngine | Sequence[AnyEngine],
        *,
        batch_size: int | None = None,
        retry_base: float = 1.0,
        retry_cap: float = 600.0,
        stop_event: threading.Event | None = None,
        app: Sequence[str] = (),
    ) -> None:
        super().__init__(engine, batch_size=batch_size, stop_event=stop_event, app=app)
        backend = self.engines.jobs
        if backend is None:
            raise ValueError(
                "enqueuer: the engine has no job backend; create it with "
                "Engine(..., jobs=InProcessBackend(...)) or set engine.jobs"
            )
        self.backend: JobBackend = backend
        self.retry_base = retry_base
        self.retry_cap = retry_cap

    def run_once(self) -> EnqueuerResult:
        result = EnqueuerResult()
        if self.distributed:
            self.by_scope(_DUE_SCOPES, {}, lambda scope: self._batch(scope, result))
        else:
            self.in_batches(lambda: self._batch(None, result))
        self.engines.observer.worker_pass(self.name)
        return result

    def _batch(self, scope: str | None, result: EnqueuerResult) -> int:
        """Publish one batch of jobs, of ``scope`` or of every scope (``None``: see
        :func:`_claim_jobs`), in one transaction; returns how many jobs it claimed."""
        with self.db.begin() as conn:
            params = {"scope": scope, "batch_size": self.batch_size}
            claim = _CLAIM_EVERY_SCOPE if scope is None else _CLAIM_IN_SCOPE
            rows = conn.execute(claim, params).all()
            claimed_at = time.monotonic()  # a job's lag: its age at the claim, plus since
            observer = self.engines.observer
            published: list[tuple[str, int]] = []
            failures: list[dict[str, object]] = []
            first_failure: dict[str, object] = {}
            unknown: dict[str, int] = {}  # jobs of each name the backend has no handler for
            for row in rows:
                job = Job(row.job_name, row.job_args, row.job_key, row.trace_context, row.scope)
                try:
                    with observer.publishing(job.name, job.job_key, job.trace_context):
                        self.backend.publish(job)
                except Exception as exc:
                    error = describe(exc)
                    delay = backoff_delay(row.attempts, base=self.retry_base, cap=self.retry_cap)
                    failures.append(
                        {"scope": row.scope, "id": row.id, "error": error[:2000], "retry_in": delay}
                    )
                    if isinstance(exc, UnknownJob):
                        observer.job_unknown(job.name)
                        unknown[job.name] = unknown.get(job.name, 0) + 1
                        continue
                    observer.job_publish_failed(job.name)
                    first_failure = first_failure or {
                        "job_id": row.id,
                        "job_name": row.job_name,
                        "job_key": row.job_key,
                        "attempts": row.attempts + 1,
                        "retry_in": round(delay, 3),
                        "error": error,
                    }
                else:
                    published.append((row.scope, row.id))
                    observer.job_published(job.name, row.age + time.monotonic() - claimed_at)
                    if faults.active:
                        # Published, not yet deleted: a crash here re-publishes the batch.
                        faults.hit("after_publish", row.job_name)
            if published:
                scopes, ids = map(list, zip(*published, strict=True))
                if scope is None:
                    conn.execute(_DELETE_PUBLISHED, {"scopes": scopes, "ids": ids})
                else:
                    conn.execute(_DELETE_PUBLISHED_IN_SCOPE, {"scope": scope, "ids": ids})
            if failures:
                conn.execute(_POSTPONE, failures)
            failed = len(failures) - sum(unknown.values())
            if failed:
                # One line per batch, not per job: a broker outage fails them all alike.
                # Each job's own error is in staged_jobs.last_error.
                self.log(logging.WARNING, "publish_failed", failed=failed, **first_failure)
            for name, jobs in unknown.items():
                self._unknown(name, jobs)
        result.batches += 1
        result.published += len(published)
        result.failed += failed
        result.unknown += sum(unknown.values())
        return len(rows)

    def _unknown(self, name: str, jobs: int) -> None:
        """One error line per batch and name of jobs the backend has no handler for."""
        self.log(
            logging.ERROR,
            "unknown_job",
            job_name=name,
            jobs=jobs,
            app=" ".join(self.app) or "-",
            hint=f"the job backend has no handler for {name!r}: "
            f"{self.how_to_register('its handler (@backend.handler)')}; the jobs stay "
            "staged and are tried again, backed off",
        )
