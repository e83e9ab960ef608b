"""What a phase receives: the transaction and state of an atomic phase (sync or async),
the keys of a foreign step."""

from typing import TYPE_CHECKING, Any

from .atomic import AtomicContext
from .common import KeyIdentity, StagedJob, StepContext

if TYPE_CHECKING:
    from .atomic_async import AsyncAtomicContext

__all__ = ["AsyncAtomicContext", "AtomicContext", "KeyIdentity", "StagedJob", "StepContext"]


def __getattr__(name: str) -> Any:
    # Imported when first asked for, as recoverypoint.engine's AsyncEngine is (why: there).
    if name == "AsyncAtomicContext":
        from .atomic_async import AsyncAtomicContext

        return AsyncAtomicContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
