"""Compensations: what the completer does, on each pass, for abandoned keys.

An operation may declare what undoes its committed phases once a key is abandoned
(:meth:`Operation.compensation`). Whoever abandoned the key (the completer or a client's
claim after ``max_attempts``, an operator with ``recoverypoint keys abandon`` or the
console, from a process that need not load the application), the completer's next pass
runs it: it takes the leases of abandoned keys awaiting a compensation (``FOR UPDATE SKIP
LOCKED``, one scope at a time, under one fencing token), then :meth:`Engine.compensate`
runs each in a transaction of its own that commits ``compensated_at``. So two completers
never run one key's compensation twice: the second finds the row locked or its lease held,
and a compensation whose lease was taken over finds its fence gone and commits nothing.

Which keys await one: those whose ``compensation_due_at`` has come, of a registered
version that declares a compensation. Every abandonment sets it to the abandonment's time
(but that of a key compensated before, then reopened); keys abandoned before migration
0013, compensated, or reopened have none (NULL), so they are never touched, and a later
write to any other column of the row (an operator's action, say) changes nothing. Its
partial index, by operation and version first, holds only the keys it is set on: the
search reads none of an operation that declares no compensation. A compensation that
raises keeps its error in ``last_error``, counts ``compensation_attempts`` and pushes
``compensation_due_at`` back, exponentially within the engine's ``retry_base`` and
``retry_cap``. It is tried until it commits, which clears it; every failure is logged and
counted, and ``recoverypoint doctor`` reports the keys whose compensation has failed, for
a human.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from .. import backoff
from ..engine import Engine, async_engine_type
from ..errors import DatabaseUnavailable, KeyInUse, LockLost
from ..leases import REGISTERED, free, registered
from .loop import Worker, registered_scopes

if TYPE_CHECKING:
    from ..engine import AsyncEngine

# How last_error begins after a failed compensation, to tell it from the error the key was
# abandoned with.
_FAILED_PREFIX = "compensation failed: "

# Due, and not run already: a key reopened after its compensation and abandoned again
# is due (the abandonment writes the moment alone, as Citus allows no now() in a CASE)
# but never compensated twice.
DUE = "k.compensation_due_at <= now() AND k.compensated_at IS NULL"

# The scopes with abandoned keys due for a compensation, longest due first.
_DUE_SCOPES = registered_scopes(DUE, "k.compensation_due_at")

# Take the leases of a batch of one scope's keys due for a compensation, under one token.
_CLAIM = text(
    f"""
    WITH {REGISTERED},
    due AS (
        SELECT k.id, r.lock_timeout
        FROM idempotency_keys AS k
        JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
        WHERE k.scope = :scope AND {DUE} AND {free("r.lock_timeout")}
        ORDER BY k.compensation_due_at
        LIMIT :batch_size
        FOR UPDATE OF k SKIP LOCKED
    )
    UPDATE idempotency_keys AS k
    SET locked_at = now(), lock_token = :token, lock_timeout = due.lock_timeout
    FROM due
    WHERE k.scope = :scope AND k.id = due.id
    RETURNING k.id, k.operation, k.operation_version, k.compensation_attempts
    """
)

# A compensation that raised: the lease given up, the error kept, the failure counted and
# the next try backed off.
_FAILED = text(
    """
    UPDATE idempotency_keys AS k
    SET locked_at = NULL, lock_token = NULL, last_error = :error,
        compensation_attempts = k.compensation_attempts + 1,
        compensation_due_at = now() + make_interval(secs => :retry_in)
    WHERE k.scope = :scope AND k.id = :id AND k.lock_token = :token
    """
)

RunAsync = Callable[[Coroutine[Any, Any, bool]], bool]
"""Runs a coroutine to its end on the completer's event loop."""


class Compensator:
    """The compensations of a completer's pass; ``worker`` logs and knows when to stop."""

    def __init__(self, worker: Worker[Any], run_async: RunAsync) -> None:
        self.worker = worker
        self.run_async = run_async

    def run_once(self) -> tuple[int, int]:
        """Compensate the abandoned keys due; how many committed, and how many failed."""
        operations = [
            op for op in self.worker.engines.operations if op.compensation_phase is not None
        ]
        if not operations:  # nothing declares one: no statement at all
            return 0, 0
        params = registered(operations)
        done = failed = 0

        def batch(scope: str) -> int:
            nonlocal done, failed
            token = uuid.uuid4()
            claim = {**params, "scope": scope, "token": token, "batch_size": self.worker.batch_size}
            with self.worker.db.begin() as conn:
                keys = conn.execute(_CLAIM, claim).all()
            for key_id, name, version, failures in keys:
                # Stopping, a key not run keeps the lease until it expires: no double run.
                if self.worker.stopping:
                    break
                ok = self._compensate(scope, key_id, name, version, failures, token)
                done, failed = done + (ok is True), failed + (ok is False)
            return len(keys)

        self.worker.by_scope(_DUE_SCOPES, params, batch)
        return done, failed

    def _compensate(
        self, scope: str, key_id: int, name: str, version: int, failures: int, token: uuid.UUID
    ) -> bool | None:
        """Run one key's compensation, which has failed ``failures`` times before: ``True``
        if it committed, ``False`` if it failed, ``None`` if the key was no longer this
        pass's to compensate."""
        engines = self.worker.engines
        kind = async_engine_type()
        engine: Engine | AsyncEngine
        if kind is not None and engines.runs_async(name, version):
            engine = engines.owner(name, version, kind)[0]
        else:
            engine = engines.owner(name, version, Engine)[0]
        try:
            if isinstance(engine, Engine):
                ran = engine.compensate(key_id, scope=scope, token=token)
            else:
                ran = self.run_async(engine.compensate(key_id, scope=scope, token=token))
        except (KeyInUse, LockLost, DatabaseUnavailable):
            return None  # another holder, or the database away: the lease runs out
        except Exception as exc:
            error = f"{_FAILED_PREFIX}{type(exc).__name__}: {exc}"[:2000]
            params = {
                "scope": scope,
                "id": key_id,
                "token": token,
                "error": error,
                "retry_in": backoff.backoff_delay(
                    failures, base=engine.retry_base, cap=engine.retry_cap
                ),
            }
            with self.worker.db.begin() as conn:
                conn.execute(_FAILED, params)
            engine.observer.key_compensated(name, False)
            self.worker.log_error(
                "compensation_failed",
                exc,
                key_id=key_id,
                operation=name,
                version=version,
                hint="fix the compensation: it is tried again, backed off, until it commits",
            )
            return False
        if ran:
            engine.observer.key_compensated(name, True)
            self.worker.log(logging.INFO, "compensated", key_id=key_id, operation=name)
        return ran or None


def run_on(loop_of: Callable[[], asyncio.AbstractEventLoop]) -> RunAsync:
    """A :data:`RunAsync` on the event loop ``loop_of()`` returns when called."""
    return lambda coroutine: loop_of().run_until_complete(coroutine)
