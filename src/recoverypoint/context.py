"""What a phase receives (its home is :mod:`recoverypoint.engine.context`, with the rest of
the request path): the transaction and state of an atomic phase, the keys of a foreign
step."""

from .engine.context import (
    AsyncAtomicContext,
    AtomicContext,
    KeyIdentity,
    StagedJob,
    StepContext,
)

__all__ = ["AsyncAtomicContext", "AtomicContext", "KeyIdentity", "StagedJob", "StepContext"]
