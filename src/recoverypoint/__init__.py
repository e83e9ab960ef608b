"""recoverypoint: multi-step operations with side effects, safe to retry.

Declare an :class:`Operation` as atomic phases and foreign steps, register it with an
:class:`Engine`, and run each request under its idempotency key.
"""

from . import _moved
from .engine import AsyncEngine, Engine
from .engine.context import AsyncAtomicContext, AtomicContext, StepContext
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

_moved.install()  # the request path's old module names, for one release
