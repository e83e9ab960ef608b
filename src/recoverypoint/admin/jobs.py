"""Staged jobs: list, show, retry (publish now), delete.

An enqueuer holds a job's row lock from the moment it claims it until it has published
it and deleted it. Actions take rows with ``SKIP LOCKED``: a job being published right now
is passed over (a single one is refused), so an action never undoes or repeats a publish
in progress; once published, the job is gone and there is nothing left to act on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from . import audit
from .base import Admin, NotFound, Refused
from .keys import JOB_COLUMNS, Job

SAMPLE_SIZE = 5


@dataclass(frozen=True)
class JobFilter:
    ids: tuple[int, ...] = ()
    name: str | None = None
    key_id: int | None = None
    """Jobs staged by this key record."""
    failing: bool = False
    """Only jobs whose publish failed at least once."""
    before: int | None = None
    """Only jobs older than the job with this id: the next page of a listing."""
    limit: int | None = 50

    def is_empty(self) -> bool:
        return not (self.ids or self.name or self.key_id is not None or self.failing)


@dataclass(frozen=True)
class JobActionResult:
    action: str
    matched: tuple[int, ...]
    changed: tuple[int, ...]
    dry_run: bool = False
    sample: tuple[Job, ...] = ()

    @property
    def skipped(self) -> tuple[int, ...]:
        """Jobs an enqueuer was publishing (or had published) meanwhile."""
        done = set(self.changed)
        return tuple(i for i in self.matched if i not in done)


_SELECT = sa.text(
    f"""
    SELECT {JOB_COLUMNS} FROM staged_jobs AS j
    WHERE (CAST(:ids AS bigint[]) IS NULL OR j.id = ANY(CAST(:ids AS bigint[])))
      AND (CAST(:name AS text) IS NULL OR j.job_name = :name)
      AND (CAST(:key_id AS bigint) IS NULL OR j.idempotency_key_id = :key_id)
      AND (NOT :failing OR j.attempts > 0)
      AND (CAST(:before AS bigint) IS NULL OR j.id < :before)
    ORDER BY j.id DESC
    LIMIT :limit
    """
)

# The jobs of one scope not being published right now: every statement names the scope, so
# on Citus it runs on that scope's shard alone (Citus refuses FOR UPDATE across shards).
_FREE = """
    SELECT id FROM staged_jobs
    WHERE scope = :scope AND id = ANY(CAST(:ids AS bigint[]))
    FOR UPDATE SKIP LOCKED
"""

_RETRY = sa.text(
    f"""
    UPDATE staged_jobs SET next_attempt_at = now(),
        attempts = CASE WHEN :reset THEN 0 ELSE attempts END
    WHERE scope = :scope AND id IN ({_FREE})
    RETURNING id
    """
)

_DELETE = sa.text(f"DELETE FROM staged_jobs WHERE scope = :scope AND id IN ({_FREE}) RETURNING id")

_SCOPES = sa.text("SELECT id, scope FROM staged_jobs WHERE id = ANY(CAST(:ids AS bigint[]))")


def list_jobs(admin: Admin, filters: JobFilter) -> list[Job]:
    """Staged jobs, newest first (by id, as keys are listed)."""
    params = dataclasses.asdict(filters)
    params["ids"] = list(filters.ids) or None
    with admin.db.connect() as conn:
        return [Job(**row._mapping) for row in conn.execute(_SELECT, params)]


def find_job(admin: Admin, job_id: int) -> Job:
    found = list_jobs(admin, JobFilter(ids=(job_id,)))
    if not found:
        raise NotFound(
            f"there is no staged job {job_id}: it was published (and deleted) or never "
            "staged; list jobs with `recoverypoint jobs list`"
        )
    return found[0]


def retry_jobs(
    admin: Admin, target: int | JobFilter, *, reset_attempts: bool = False, dry_run: bool = False
) -> JobActionResult:
    """Make jobs due now: the enqueuer publishes them on its next pass."""
    return _act(admin, "jobs.retry", target, _RETRY, dry_run, {"reset": reset_attempts})


def delete_jobs(admin: Admin, target: int | JobFilter, *, dry_run: bool = False) -> JobActionResult:
    """Delete staged jobs: they will never be published."""
    return _act(admin, "jobs.delete", target, _DELETE, dry_run, {})


def _act(
    admin: Admin,
    action: str,
    target: int | JobFilter,
    statement: sa.TextClause,
    dry_run: bool,
    params: dict[str, Any],
) -> JobActionResult:
    jobs = [find_job(admin, target)] if isinstance(target, int) else list_jobs(admin, target)
    ids = tuple(job.id for job in jobs)
    if dry_run:
        return JobActionResult(action, ids, (), True, tuple(jobs[:SAMPLE_SIZE]))
    found: list[int] = []
    with admin.db.begin() as conn:
        if ids:
            by_scope: dict[str, list[int]] = {}
            for job_id, scope in conn.execute(_SCOPES, {"ids": list(ids)}):
                by_scope.setdefault(scope, []).append(job_id)
            for scope, scoped in by_scope.items():
                scoped_params = {**params, "scope": scope, "ids": scoped}
                found += conn.execute(statement, scoped_params).scalars()
        changed = tuple(sorted(found))
        audit.record(conn, admin, action, changed, matched=len(ids), **params)
    if isinstance(target, int) and not changed:
        raise Refused(
            f"job {target} is being published by an enqueuer right now (or just was): "
            "nothing was done; look again with `recoverypoint jobs show`"
        )
    return JobActionResult(action, ids, changed)
