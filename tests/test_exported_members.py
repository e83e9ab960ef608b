"""The public surface, name by name, as httpx guards its own: every name a user may import
from the package and its public subpackages is listed here, so that adding, renaming or
dropping one is a change a review sees. Each ``__all__`` is sorted (constants, classes,
then functions, each alphabetically, as ruff's RUF022 sorts them) and names only what the
module has."""

from __future__ import annotations

import importlib
import re
import sys
import warnings

import pytest

from recoverypoint._moved import MOVED

SURFACE = {
    "recoverypoint": [
        "AbandonedCall",
        "AsyncAtomicContext",
        "AsyncEngine",
        "AtomicContext",
        "ConcurrentUpdate",
        "ConfigurationError",
        "DatabaseUnavailable",
        "DeclarationError",
        "Engine",
        "IdempotencyError",
        "InvalidKey",
        "InvalidParams",
        "KeyInUse",
        "LockLost",
        "NeedsReconciliation",
        "NotFound",
        "Operation",
        "OperationNotRegistered",
        "Outcome",
        "ParamsMismatch",
        "PhaseLeftScope",
        "RecoveryPoint",
        "Request",
        "RequestTooLarge",
        "Response",
        "Retryable",
        "StepContext",
        "TransactionEnded",
        "Withdrawn",
        "downstream_key",
        "idempotent",
    ],
    "recoverypoint.admin": [
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
    ],
    "recoverypoint.engine": ["ABANDONED_RESPONSE", "AsyncEngine", "Engine"],
    "recoverypoint.workers": [
        "ABANDONED_RESPONSE",
        "Completer",
        "CompleterResult",
        "Enqueuer",
        "EnqueuerResult",
        "Reaper",
        "ReaperResult",
        "Result",
        "Worker",
        "on_stop",
    ],
    "recoverypoint.console": [
        "ACTIONS",
        "KEY_ACTIONS",
        "REVEAL",
        "VIEW",
        "Authorize",
        "OwnHosts",
        "TokenLock",
        "console",
    ],
    "recoverypoint.integrations": [
        "IDEMPOTENCY_KEY",
        "IDEMPOTENT_REPLAYED",
        "IDEMPOTENT_UNPROTECTED",
        "RETRY_AFTER",
        "UNSCOPED",
    ],
}


def isort_order(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions and instances (RUF022's order)."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_the_public_surface_is_the_one_listed(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert exported == SURFACE[module]


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_the_surface_is_sorted_and_every_name_exists(module: str) -> None:
    imported = importlib.import_module(module)
    assert imported.__all__ == sorted(imported.__all__, key=isort_order)
    assert len(set(imported.__all__)) == len(imported.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a listed name is never a deprecated alias
        missing = [name for name in imported.__all__ if not hasattr(imported, name)]
    assert not missing


def test_a_renamed_name_still_imports_and_says_where_it_went() -> None:
    from recoverypoint import admin

    with pytest.warns(DeprecationWarning, match="PhaseMark"):
        assert admin.Phase is admin.PhaseMark  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        admin.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_a_moved_module_imports_under_its_old_name_and_says_where(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # The module keeps its own spec: its relative imports (run later, inside functions)
    # resolve against its package, and raise no warning that its package is another.
    assert module.__spec__ is not None and module.__spec__.name == new
    assert module.__package__ == module.__spec__.parent


def test_the_old_homes_of_the_engines_and_the_phase_context_still_serve() -> None:
    import recoverypoint as rp
    from recoverypoint import context, engine

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (engine.Engine, engine.AsyncEngine) == (rp.Engine, rp.AsyncEngine)
        assert context.StepContext is rp.StepContext
        assert context.KeyIdentity is engine.context.KeyIdentity
