"""The rules of a duplicate's wait for the first call's answer (``wait=``), free of I/O.

A call that meets a key in use (:class:`~recoverypoint.KeyInUse`) may wait for the call
that holds it, when its caller asked for that with ``wait=``: it is woken by the commit
that finishes or releases the key (a NOTIFY on the key's :func:`channel`, sent in that very
transaction), and then claims again: a replay, or, if the holder failed, the key to run.
The NOTIFY is sent only while someone waits: a waiter holds the key's :func:`lock` shared,
which the finishing write then fails to take.

A wait is bounded twice, so that duplicates cannot pin the database's resources: each
lasts at most :data:`MAX_WAIT`, and an engine lets at most :data:`MAX_WAITERS` wait at once
(each holds one connection of its own, outside the pool, and no transaction); a duplicate
beyond them gets its :class:`~recoverypoint.KeyInUse` at once.
"""

from __future__ import annotations

import hashlib
import math
import threading
from datetime import timedelta

MAX_WAIT = timedelta(seconds=60)
"""The longest a duplicate may wait: longer, a client is better told 409 and to retry."""

MAX_WAITERS = 16
"""How many calls may wait at once on one engine, each on a connection of its own."""

CHANNEL_PREFIX = "recoverypoint_"
"""The NOTIFY channels' prefix; the rest is the md5 of the key's identity."""


class CannotWait(Exception):
    """The connection to wait on failed (to open, or while waiting): the call is answered
    as it would be without a wait."""


def wait_seconds(wait: object) -> float:
    """``wait`` (a :class:`~datetime.timedelta`, seconds, or ``None`` for no wait) in
    seconds; a :class:`ValueError` for anything else, a negative or not finite value, or
    one over :data:`MAX_WAIT`."""
    if wait is None:
        return 0.0
    if isinstance(wait, timedelta):
        seconds = wait.total_seconds()
    elif isinstance(wait, int | float) and not isinstance(wait, bool):
        seconds = float(wait)
    else:
        raise ValueError(f"wait must be a timedelta or a number of seconds, got {wait!r:.80}")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_WAIT.total_seconds():
        raise ValueError(
            f"wait must be between 0 and {MAX_WAIT.total_seconds():g} seconds, got {wait!r:.80}"
        )
    return seconds


def channel(scope: str, operation: str, key: str) -> str:
    """The NOTIFY channel of one key, which the writes that wake its waiters notify (sql.py's
    ``_WAKE``, given it by :func:`wake`). A hash (an identifier holds 63 bytes); a collision
    only wakes a waiter for nothing."""
    return CHANNEL_PREFIX + _identity(scope, operation, key)


def lock(scope: str, operation: str, key: str) -> int:
    """The advisory lock a waiter holds shared on one key: the first 64 bits of the same
    hash, as a signed bigint."""
    return _lock(_identity(scope, operation, key))


def wake(scope: str, operation: str, key: str) -> tuple[int, str]:
    """The key's :func:`lock` and :func:`channel` from one hash: for a waiter, and for the
    writes that wake the key's waiters (computed once per run rather than by the server in
    every such write, where the hash of the row's columns cost 1 % of a fresh request's
    server instructions)."""
    identity = _identity(scope, operation, key)
    return _lock(identity), CHANNEL_PREFIX + identity


def _identity(scope: str, operation: str, key: str) -> str:
    identity = "\x1f".join((scope, operation, key)).encode()
    return hashlib.md5(identity, usedforsecurity=False).hexdigest()


def _lock(identity: str) -> int:
    value = int(identity[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


class WaitSlots:
    """The waits an engine allows at once; taken without blocking (a duplicate that finds
    none free is refused at once, not queued), from threads or an event loop."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._free <= 0:
                return False
            self._free -= 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._free += 1
