"""What every operator query and action shares: the database, the operations it knows,
the states a key can be in, and the two ways an action says no.

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
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..operation import DEFAULT_RETENTION as DEFAULT_RETENTION
from ..operation import Operation
from .mask import Mask

if TYPE_CHECKING:
    from ..engine import Engine

UNFINISHED, IN_FLIGHT, STUCK, FINISHED, ABANDONED = (
    "unfinished",
    "in-flight",
    "stuck",
    "finished",
    "abandoned",
)
STATES = (UNFINISHED, IN_FLIGHT, STUCK, FINISHED, ABANDONED)
"""Each key is in exactly one: ``in-flight`` (unfinished, its lease live), ``stuck``
(unfinished, lease free or expired, next attempt overdue by more than ``stuck_after``),
``unfinished`` (any other unfinished key: waiting for its next attempt or its client),
``finished`` (with its response) and ``abandoned`` (finished with an error response by the
completer or an operator)."""

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
        """The bind parameters of the ``registered`` table (see _sql.REGISTERED)."""
        ops = list(operations)
        return {
            "operations": [op.name for op in ops],
            "versions": [op.version for op in ops],
            "lock_timeouts": [op.lock_timeout.total_seconds() for op in ops],
            "stuck_after": self.stuck_after.total_seconds(),
        }

    def params(self) -> dict[str, Any]:
        return self.known(self.operations)

    @functools.cached_property
    def mask(self) -> Mask:
        """The installation's :class:`Mask`, read from the database once."""
        return Mask.of(self.db)
