"""The operator's library: find, explain and fix any key or staged job.

Every query and action of ``recoverypoint keys|jobs|doctor`` lives here, so the CLI, a
metrics collector and a web console share one implementation::

    from recoverypoint import admin

    ops = admin.Admin.for_engine(engine)             # or admin.Admin(sa_engine, operations)
    for row in admin.list_keys(ops, admin.KeyFilter(states=("stuck",))):
        admin.retry(ops, row.id)

Actions are fenced like the engine's own writes (see :mod:`.key_actions`), recorded in the
``audit_log`` table in their own transaction (see :mod:`.audit`) and logged on the
``recoverypoint.admin`` logger.
"""

import warnings

from .audit import AuditEntry, audit_entries, find_audit_entry
from .base import (
    ABANDONED,
    DEFAULT_ABANDONED_RETENTION,
    DEFAULT_RETENTION,
    DEFAULT_STUCK_AFTER,
    FINISHED,
    IN_FLIGHT,
    NEEDS_RECONCILIATION,
    STATES,
    STUCK,
    UNFINISHED,
    Admin,
    KeyState,
    NotFound,
    Refused,
)
from .doctor import Check, WorkerPass, diagnose, worker_passes
from .jobs import JobActionResult, JobFilter, delete_jobs, find_job, list_jobs, retry_jobs
from .key_actions import (
    ABANDON_EFFECTS,
    DEFAULT_ABANDON_MESSAGE,
    DEFAULT_ABANDON_STATUS,
    ActionResult,
    abandon,
    available,
    delete,
    purge,
    reconcile,
    release,
    reopen,
    retry,
)
from .keys import (
    Job,
    KeyDetail,
    KeyFilter,
    KeyRow,
    PhaseMark,
    Stats,
    StatsRow,
    compensation,
    compensation_state,
    find_key,
    list_keys,
    stats,
)
from .mask import Mask
from .overview import Hour, Overview, overview
from .unfinishable import Unfinishable, UnfinishableKeys, UnknownJobs, unfinishable

__all__ = [
    "ABANDONED",
    "ABANDON_EFFECTS",
    "DEFAULT_ABANDONED_RETENTION",
    "DEFAULT_ABANDON_MESSAGE",
    "DEFAULT_ABANDON_STATUS",
    "DEFAULT_RETENTION",
    "DEFAULT_STUCK_AFTER",
    "FINISHED",
    "IN_FLIGHT",
    "NEEDS_RECONCILIATION",
    "STATES",
    "STUCK",
    "UNFINISHED",
    "ActionResult",
    "Admin",
    "AuditEntry",
    "Check",
    "Hour",
    "Job",
    "JobActionResult",
    "JobFilter",
    "KeyDetail",
    "KeyFilter",
    "KeyRow",
    "KeyState",
    "Mask",
    "NotFound",
    "Overview",
    "PhaseMark",
    "Refused",
    "Stats",
    "StatsRow",
    "Unfinishable",
    "UnfinishableKeys",
    "UnknownJobs",
    "WorkerPass",
    "abandon",
    "audit_entries",
    "available",
    "compensation",
    "compensation_state",
    "delete",
    "delete_jobs",
    "diagnose",
    "find_audit_entry",
    "find_job",
    "find_key",
    "list_jobs",
    "list_keys",
    "overview",
    "purge",
    "reconcile",
    "release",
    "reopen",
    "retry",
    "retry_jobs",
    "stats",
    "unfinishable",
    "worker_passes",
]


def __getattr__(name: str) -> object:
    # Renamed names, kept importable for one release.
    if name == "Phase":
        warnings.warn(
            "recoverypoint.admin.Phase is now recoverypoint.admin.PhaseMark",
            DeprecationWarning,
            stacklevel=2,
        )
        return PhaseMark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
