"""What a phase receives (its home is :mod:`recoverypoint.engine.context`, with the rest of
the request path): the transaction and state of an atomic phase, the keys of a foreign
step."""

from typing import TYPE_CHECKING, Any

from .engine import context
from .engine.context import AtomicContext, KeyIdentity, StagedJob, StepContext

if TYPE_CHECKING:
    from .engine.context import AsyncAtomicContext

__all__ = ["AsyncAtomicContext", "AtomicContext", "KeyIdentity", "StagedJob", "StepContext"]


def __getattr__(name: str) -> Any:
    if name == "AsyncAtomicContext":  # imported when first asked for
        return context.AsyncAtomicContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
