"""recoverypoint: multi-step operations with side effects, safe to retry.

Declare an :class:`Operation` as atomic phases and foreign steps, register it with an
:class:`Engine`, and run each request under its idempotency key.
"""

from typing import TYPE_CHECKING, Any

from . import _moved, engine
from .engine import Engine
from .engine.context import AtomicContext, StepContext
from .errors import (
    AbandonedCall,
    ConcurrentUpdate,
    ConfigurationError,
    DatabaseUnavailable,
    DeclarationError,
    IdempotencyError,
    InvalidKey,
    InvalidParams,
    KeyInUse,
    LockLost,
    NeedsReconciliation,
    OperationNotRegistered,
    ParamsMismatch,
    PhaseLeftScope,
    RequestTooLarge,
    Retryable,
    TransactionEnded,
)
from .idempotent import downstream_key, idempotent
from .operation import (
    NotFound,
    Operation,
    Outcome,
    RecoveryPoint,
    Request,
    Response,
    Withdrawn,
)

if TYPE_CHECKING:
    from .engine import AsyncEngine
    from .engine.context import AsyncAtomicContext

__all__ = [
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
]


def __getattr__(name: str) -> Any:
    # The async engine and its phases' context, imported by their packages when first asked
    # for (recoverypoint.engine says why).
    if name == "AsyncEngine":
        return engine.AsyncEngine
    if name == "AsyncAtomicContext":
        return engine.context.AsyncAtomicContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_moved.install()  # the request path's old module names, for one release
