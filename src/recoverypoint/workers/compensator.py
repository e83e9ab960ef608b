"""Compensations: what the completer does, on each pass, for abandoned keys.

An operation may declare what undoes its committed phases once a key is abandoned
(:meth:`Operation.compensation`). Whoever abandoned the key (the completer after
``max_attempts``, an operator with ``recoverypoint keys abandon`` or the console, from a
process that need not load the application), the completer's next pass runs it: it takes
the leases of abandoned keys awaiting a compensation (``FOR UPDATE SKIP LOCKED``, one
scope at a time, under one fencing token, as it claims unfinished keys), then
:meth:`Engine.compensate` runs each in a transaction of its own that commits
``compensated_at``. So two completers never run one key's compensation twice: the second
finds the row locked or its lease held, and a compensation whose lease was taken over
finds its fence gone and commits nothing.

Which keys await one: abandoned, not compensated, of a registered version that declares a
compensation, and abandoned since this release
(:data:`~recoverypoint.admin.base.AWAITING_COMPENSATION`). Abandoning sets
``next_attempt_at`` to the abandonment's own time (``abandoned_at``), which no key
abandoned before this release has (its ``next_attempt_at`` was written by an earlier
transaction), so those are never touched; a failed compensation keeps its key awaiting
through ``last_error``, which it begins with ``compensation failed:``. ``next_attempt_at``
is then when it is tried again: after as long again as the key has waited since it was
abandoned, within the engine's ``retry_base`` and ``retry_cap`` (so exponentially). It is
tried until it commits; every failure is logged and counted, and ``recoverypoint doctor``
reports the keys whose compensation has failed, for a human.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import text

from ..admin.base import AWAITING_COMPENSATION, COMPENSATION_FAILED
from ..engine import AsyncEngine, Engine
from ..errors import DatabaseUnavailable, KeyInUse, LockLost
from ..leases import REGISTERED, free, from_now, registered
from .loop import Worker

_DUE = f"{AWAITING_COMPENSATION} AND k.next_attempt_at <= now()"

# The scopes with abandoned keys due for a compensation, longest due first.
_DUE_SCOPES = text(
    f"""
    WITH {REGISTERED}
    SELECT k.scope
    FROM idempotency_keys AS k
    JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
    WHERE {_DUE} AND {free("r.lock_timeout")}
    GROUP BY k.scope ORDER BY min(k.next_attempt_at) LIMIT :scopes
    """
)

# Take the leases of a batch of one scope's keys due for a compensation, under one token.
_CLAIM = text(
    f"""
    WITH {REGISTERED},
    due AS (
        SELECT k.id, r.lock_timeout
        FROM idempotency_keys AS k
        JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
        WHERE k.scope = :scope AND {_DUE} AND {free("r.lock_timeout")}
        ORDER BY k.next_attempt_at
        LIMIT :batch_size
        FOR UPDATE OF k SKIP LOCKED
    )
    UPDATE idempotency_keys AS k
    SET locked_at = now(), lock_token = :token, lock_timeout = due.lock_timeout
    FROM due
    WHERE k.scope = :scope AND k.id = due.id
    RETURNING k.id, k.operation, k.operation_version
    """
)

# A compensation that raised: the lease given up, the error kept, the next try backed off
# (after as long again as the key has waited since it was abandoned, within :base and :cap).
_RETRY_IN = "least(:cap, greatest(:base, extract(epoch FROM now() - k.abandoned_at)))"
_FAILED = text(
    f"""
    UPDATE idempotency_keys AS k
    SET locked_at = NULL, lock_token = NULL, last_error = :error,
        next_attempt_at = {from_now(_RETRY_IN)}
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
        for scope in self.worker.scopes_due(_DUE_SCOPES, params):
            while not self.worker.stopping:
                token = uuid.uuid4()
                claim = {
                    **params,
                    "scope": scope,
                    "token": token,
                    "batch_size": self.worker.batch_size,
                }
                with self.worker.db.begin() as conn:
                    batch = conn.execute(_CLAIM, claim).all()
                for key_id, name, version in batch:
                    # Stopping, a key not run keeps the lease until it expires: no double run.
                    if self.worker.stopping:
                        break
                    ok = self._compensate(scope, key_id, name, version, token)
                    done, failed = done + (ok is True), failed + (ok is False)
                if len(batch) < self.worker.batch_size:
                    break
        return done, failed

    def _compensate(
        self, scope: str, key_id: int, name: str, version: int, token: uuid.UUID
    ) -> bool | None:
        """Run one key's compensation: ``True`` if it committed, ``False`` if it failed,
        ``None`` if the key was no longer this pass's to compensate."""
        engines = self.worker.engines
        engine: Engine | AsyncEngine
        if engines.runs_async(name, version):
            engine = engines.owner(name, version, AsyncEngine)[0]
        else:
            engine = engines.owner(name, version, Engine)[0]
        try:
            if isinstance(engine, AsyncEngine):
                ran = self.run_async(engine.compensate(key_id, scope=scope, token=token))
            else:
                ran = engine.compensate(key_id, scope=scope, token=token)
        except (KeyInUse, LockLost, DatabaseUnavailable):
            return None  # another holder, or the database away: the lease runs out
        except Exception as exc:
            error = f"{COMPENSATION_FAILED}{type(exc).__name__}: {exc}"[:2000]
            params = {
                "scope": scope,
                "id": key_id,
                "token": token,
                "error": error,
                "base": engine.retry_base,
                "cap": engine.retry_cap,
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
