"""The keys and jobs no running worker can finish, as ``recoverypoint doctor`` and the
console report them: from any process, without loading the application.

- keys: stuck keys (unfinished, nobody holding them, their next attempt overdue by more
  than ``stuck_after``), and abandoned keys whose compensation has been due as long, of
  operation versions no running completer registers. Each completer records what it
  registers with every pass (:mod:`recoverypoint.running`), so what one process misses is
  told from what another finishes. With no completer running, every stuck key waits for
  one: the doctor's workers check is the one to say so.
- jobs: staged jobs whose last publish found no handler for them in the job backend
  (:class:`~recoverypoint.jobs.UnknownJob`, kept as their ``last_error``).

An abandoned key's compensation is counted whether or not its version declares one: with
the version registered nowhere, nobody here can tell.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from ..jobs import UnknownJob
from ..running import KNOWN, RUNNING
from ._sql import REGISTERED, STATE
from .base import STUCK, Admin

_OVERDUE = "now() - make_interval(secs => CAST(:stuck_after AS double precision))"

# Through the partial indexes of the unfinished keys and of the compensations due.
_KEYS = sa.text(
    f"""
    WITH {REGISTERED}, {KNOWN},
    waiting AS (
        SELECT k.operation, k.operation_version, 1 AS keys, 0 AS compensations
        FROM idempotency_keys AS k
        WHERE k.finished_at IS NULL AND k.next_attempt_at < {_OVERDUE}
          AND ({STATE}) = '{STUCK}'
        UNION ALL
        SELECT k.operation, k.operation_version, 0, 1
        FROM idempotency_keys AS k
        WHERE k.compensation_due_at < {_OVERDUE} AND k.compensated_at IS NULL
    )
    SELECT w.operation, w.operation_version AS version,
           sum(w.keys)::integer AS keys, sum(w.compensations)::integer AS compensations
    FROM waiting AS w
    WHERE NOT EXISTS (SELECT 1 FROM known AS o
                      WHERE o.operation = w.operation AND o.version = w.operation_version)
    GROUP BY w.operation, w.operation_version
    ORDER BY w.operation, w.operation_version
    """
)

_JOBS = sa.text(
    """
    SELECT job_name AS job, count(*) AS jobs FROM staged_jobs
    WHERE starts_with(last_error, :unknown)
    GROUP BY job_name ORDER BY job_name
    """
)

_RUNNING = sa.text(f"SELECT count(*) FROM completer_operations AS c WHERE {RUNNING}")


@dataclass(frozen=True)
class UnfinishableKeys:
    """The keys of one operation version no running completer registers."""

    operation: str
    version: int
    keys: int
    """Stuck keys."""
    compensations: int
    """Abandoned keys whose compensation, if the version declares one, is overdue."""


@dataclass(frozen=True)
class UnknownJobs:
    """The staged jobs of one name the job backend had no handler for."""

    job: str
    jobs: int


@dataclass(frozen=True)
class Unfinishable:
    completers: int
    """Completers running (their last pass not late)."""
    keys: tuple[UnfinishableKeys, ...]
    jobs: tuple[UnknownJobs, ...]

    def __bool__(self) -> bool:
        return bool(self.keys or self.jobs)


def unfinishable(admin: Admin) -> Unfinishable:
    """The keys and staged jobs no running worker can finish."""
    with admin.db.connect() as conn:
        completers = conn.execute(_RUNNING).scalar_one()
        keys = conn.execute(_KEYS, admin.params()).all()
        jobs = conn.execute(_JOBS, {"unknown": f"{UnknownJob.__name__}: "}).all()
    return Unfinishable(
        completers,
        tuple(UnfinishableKeys(**row._mapping) for row in keys),
        tuple(UnknownJobs(**row._mapping) for row in jobs),
    )
