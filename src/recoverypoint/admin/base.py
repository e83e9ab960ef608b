"""What every operator query and action shares: the database, the operations it knows,
the states a key can be in (:class:`KeyState`), and the two ways an action says no.

Knowing the operations (an :class:`~recoverypoint.Engine`'s, or a list) gives each key its
declared phases and its downstream keys; without them only the stored recovery point is
shown. A lease is judged by the lock timeout its holder stored with it, known or not.
"""

from __future__ import annotations

import functools
import getpass
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..leases import registered
from ..operation import DEFAULT_RETENTION as DEFAULT_RETENTION
from ..operation import Operation
from .mask import Mask

if TYPE_CHECKING:
    from ..engine import Engine


class KeyState(str, Enum):
    """The state a key is in, as the operator sees it; each key is in exactly one. The
    database decides it (its clock, the lease its holder took: :mod:`recoverypoint.leases`)."""

    UNFINISHED = "unfinished"
    """No request holds it and it is not stuck: waiting for its client to retry, or for its
    next attempt (the completer's). A claim, the completer or ``retry`` make it
    ``in-flight``; an overdue next attempt makes it ``stuck``."""

    IN_FLIGHT = "in-flight"
    """A request or the completer holds its lease, and nobody may take it over. It leaves
    when the holder commits its last phase (``finished``), fails or is stopped (the lease
    given up: ``unfinished``), or stops renewing the lease for its lock timeout."""

    STUCK = "stuck"
    """Unfinished, its lease free or expired, its next attempt overdue by more than
    ``stuck_after``: nobody is finishing it (is the completer running?). ``retry`` or the
    completer take it up; ``abandon`` ends it."""

    FINISHED = "finished"
    """It has its response, which every retry replays, until the reaper deletes it."""

    ABANDONED = "abandoned"
    """Finished with an error response once out of attempts (by the completer, or by the
    client retry that would have started one more) or by an operator (``abandon``);
    ``reopen`` makes it unfinished again."""

    NEEDS_RECONCILIATION = "needs-reconciliation"
    """Unfinished, stopped before a foreign step whose provider's dedupe window has passed
    and which has no reconcile hook: calling it again could repeat its first call (a second
    charge), so no request and no worker runs it. An operator finds out what that call did,
    then ``reconcile`` records its result (found) or has it called anew (not found)."""

    def __str__(self) -> str:
        return self.value


# The states' names as text, as queries and filters take them.
UNFINISHED, IN_FLIGHT, STUCK, FINISHED, ABANDONED, NEEDS_RECONCILIATION = (
    state.value for state in KeyState
)
STATES = tuple(state.value for state in KeyState)
"""Every :class:`KeyState`, by its name, in the order a listing shows them."""

DEFAULT_STUCK_AFTER = timedelta(minutes=5)

# The reaper's defaults, here so that `keys show` and the reaper read the same ones (the
# retention is the engine's too: the one it honours a finished key for).
DEFAULT_ABANDONED_RETENTION = timedelta(days=30)


class NotFound(LookupError):
    """No key or job matches: the command exits 3."""


class Refused(Exception):
    """The action's condition does not hold (any more): nothing was changed, exit 4."""


def default_actor() -> str:
    """Who runs an action, for the audit log: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name in a container: still log the host
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@dataclass(frozen=True)
class Admin:
    """The database to operate on and what is known about its operations.

    Parameters
    ----------
    db:
        A SQLAlchemy engine on the database holding ``idempotency_keys``.
    operations:
        The operations registered with the application's engine, every version: they
        give keys their phases and downstream keys (and the lock timeout of a lease taken
        before migration 0010, which stored none).
    stuck_after:
        How long past its next attempt an unleased unfinished key waits before it counts
        as stuck.
    actor:
        Who is acting, written into every audit record.
    via:
        Through what (``cli``, ``console``, ``library``), written beside the actor.
    lock_wait:
        Seconds an action waits for a running phase's row lock before refusing.
    """

    db: sa.Engine
    operations: tuple[Operation[Any], ...] = ()
    stuck_after: timedelta = DEFAULT_STUCK_AFTER
    actor: str = field(default_factory=default_actor)
    via: str = "library"
    lock_wait: float = 5.0
    retention: timedelta = DEFAULT_RETENTION
    abandoned_retention: timedelta = DEFAULT_ABANDONED_RETENTION

    @classmethod
    def for_engine(cls, engine: Engine, **options: Any) -> Admin:
        """An Admin on ``engine``'s database that knows its registered operations."""
        return cls(engine.db, tuple(engine.operations), **options)

    def operation(self, name: str, version: int) -> Operation[Any] | None:
        for operation in self.operations:
            if operation.name == name and operation.version == version:
                return operation
        return None

    def known(self, operations: Iterable[Operation[Any]]) -> dict[str, Any]:
        """The bind parameters of the ``registered`` table
        (:data:`~recoverypoint.leases.REGISTERED`) and of the states' ``stuck_after``."""
        return {**registered(operations), "stuck_after": self.stuck_after.total_seconds()}

    def params(self) -> dict[str, Any]:
        return self.known(self.operations)

    @functools.cached_property
    def mask(self) -> Mask:
        """The installation's :class:`Mask`, read from the database once."""
        return Mask.of(self.db)
