"""What a phase receives: the transaction and state of an atomic phase (sync or async),
the keys of a foreign step."""

from .atomic import AtomicContext
from .atomic_async import AsyncAtomicContext
from .common import KeyIdentity, StagedJob, StepContext

__all__ = ["AsyncAtomicContext", "AtomicContext", "KeyIdentity", "StagedJob", "StepContext"]
