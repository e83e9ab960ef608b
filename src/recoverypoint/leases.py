"""The lease: who may work on a key, and until when.

The rule: a key's lease may be taken when nobody holds it, or when its holder has not
renewed it for the lock timeout of the operation version that started the key, on the
database's clock (``now()``: one clock for every process, whatever theirs say). The holder
renews it with every phase it commits, and in the background while a foreign step runs
(:mod:`recoverypoint.engine.heartbeat`), so the lock timeout is how long after a holder dies
another may take over; every write it makes is fenced by the lease's token, so a holder
whose lease was taken over can no longer commit anything.

It is written here once in SQL (:func:`free`, :func:`seconds_left`, :data:`HELD_FOR`) and
once in Python (:func:`left`, for ``Retry-After``; :func:`free_before`, for the admin
layer's fenced actions); tests/test_leases.py checks that the two halves agree at the
boundary. Its users, and which lock timeout each judges by:

- the engine's claims (:mod:`recoverypoint.engine.sql`): the timeout of the version it
  judged the key by, a bound parameter; each claim stores it with the lease it takes;
- the completer's claim (:mod:`recoverypoint.workers.completer`): the registered version's,
  joined from :data:`REGISTERED`;
- the admin layer (:mod:`recoverypoint.admin`): the one the holder stored with its lease
  (:data:`HOLDERS_TIMEOUT`), which an operator's tool judges by whether or not it knows
  the operation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Protocol

DEFAULT_LOCK_TIMEOUT = timedelta(seconds=90)
"""The lock timeout of an operation that declares none: ``Operation``, ``@idempotent`` and
the HTTP integrations' single-step endpoints."""

# Leases are added to timestamps in SQL: beyond a few thousand years that overflows, and a
# key would fail forever. A lease of a year is already "never".
MAX_LOCK_TIMEOUT = timedelta(days=365)


def free(timeout: str) -> str:
    """SQL: whether anyone may take the lease of key row ``k``; ``timeout`` is an SQL
    expression for the lock timeout in seconds. NULL when ``timeout`` is."""
    return f"(k.locked_at IS NULL OR k.locked_at <= now() - make_interval(secs => {timeout}))"


def seconds_left(timeout: str) -> str:
    """SQL: seconds until the lease of key row ``k`` expires under ``timeout``, negative
    once it has; NULL when nobody holds it (or ``timeout`` is NULL)."""
    return f"extract(epoch FROM k.locked_at + make_interval(secs => {timeout}) - now())::float8"


HELD_FOR = "extract(epoch FROM now() - locked_at)::float8"
"""SQL: seconds since the lease of the row was taken or last renewed; NULL when free. The
engine reads it with the key row and judges it with :func:`left`."""


def left(held_for: float | None, timeout: float) -> int:
    """Whole seconds until a lease held for ``held_for`` seconds (:data:`HELD_FOR`; ``None``:
    nobody holds it) expires under ``timeout``; 0 when anyone may take it."""
    if held_for is None:
        return 0
    return max(0, math.ceil(timeout - held_for))


def free_before(now: datetime, timeout: float | None) -> datetime | None:
    """The latest time a lease may have been taken or renewed and be free at ``now`` (the
    database's, read in the same transaction) under ``timeout`` seconds; ``None`` when the
    timeout is unknown. :func:`free` with the clock read first: for statements where the
    database refuses ``now()`` beside column references (an UPDATE on Citus)."""
    if timeout is None:
        return None
    return now - timedelta(seconds=timeout)


def from_now(seconds: str) -> str:
    """SQL: the moment ``seconds`` (an SQL expression; negative: in the past) after now(),
    for an UPDATE's SET that computes it from the row's columns. Citus refuses a function
    that is not IMMUTABLE over a column there, and timestamptz +/- interval is STABLE: so
    the clock is read alone (Citus evaluates it once, on the coordinator, as it does
    now() anywhere) and the rest is IMMUTABLE arithmetic on seconds since the epoch."""
    return f"to_timestamp(extract(epoch FROM now())::float8 + ({seconds}))"


REGISTERED = """
    registered AS (
        SELECT * FROM unnest(
            CAST(:operations AS text[]), CAST(:versions AS integer[]),
            CAST(:lock_timeouts AS double precision[])
        ) AS r(operation, version, lock_timeout)
    )
"""
"""SQL: the operations the caller knows, every version with its lock timeout, as a table
(a ``WITH`` entry) whose bind parameters :func:`registered` gives."""


class Declared(Protocol):
    """What the registered table reads of an :class:`~recoverypoint.Operation`."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def lock_timeout(self) -> timedelta: ...


def registered(operations: Iterable[Declared]) -> dict[str, Any]:
    """The bind parameters of :data:`REGISTERED` for ``operations``."""
    ops = list(operations)
    return {
        "operations": [op.name for op in ops],
        "versions": [op.version for op in ops],
        "lock_timeouts": [op.lock_timeout.total_seconds() for op in ops],
    }


HOLDERS_TIMEOUT = """
    coalesce(k.lock_timeout,
             (SELECT r.lock_timeout FROM registered AS r
              WHERE r.operation = k.operation AND r.version = k.operation_version))
"""
"""SQL: the lock timeout the holder stored with its lease. A row claimed before migration
0010 has none: then the operation's, if it is known here (a subquery, not a join: it is
evaluated again on the row version an UPDATE re-checks), else NULL: a deadline nobody here
knows. Needs :data:`REGISTERED`."""
