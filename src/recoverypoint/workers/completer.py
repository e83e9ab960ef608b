"""The completer: finishes keys their clients left unfinished.

It claims due keys in small batches (``FOR UPDATE SKIP LOCKED``, so completers never wait
for or collide with one another) by taking their leases under one fencing token, then
resumes each through :meth:`Engine.resume` with that token. A failed attempt is counted by
the engine, which schedules the key's next attempt with exponential backoff and jitter
(``Engine(retry_base=…, retry_cap=…)``). Once a key has failed ``max_attempts`` times
(the operation's), it is abandoned: finished with :data:`ABANDONED_RESPONSE`, which a
retrying client gets replayed, and reported in one log line.

Only keys of operations registered with the engine, at the stored version, are claimed;
others are counted and reported, never locked or written.

One operation, or one key, that fails in a way nobody planned for never stalls the
others: when the claim fails, each operation claims on its own and only those whose claim
fails sit the pass out; an error with one key is logged and counted, and the pass goes on.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection, text

from ..admin._sql import REGISTERED  # the operations this completer can resume, as a table
from ..admin.key_actions import abandon_exhausted
from ..engine import Engine
from ..errors import KeyInUse, LockLost
from ..operation import Operation, Response
from ..sql import lease_free
from .loop import Result, Worker

ABANDONED_RESPONSE = Response(
    500,
    {
        "error": "request_abandoned",
        "message": "This request failed too many times and will not be retried.",
    },
)
"""What an abandoned key replays to a client that retries it."""

# An unfinished key whose next attempt is due and whose client has had :min_age seconds
# since its last run to come back on its own.
_DUE = """
    k.finished_at IS NULL
    AND k.next_attempt_at <= now()
    AND k.last_run_at <= now() - make_interval(secs => :min_age)
"""

# Take the leases of a batch of due keys with a free or expired lease, under one token.
# SKIP LOCKED: rows another completer (or a client's claim) holds are passed over.
_CLAIM_DUE = text(
    f"""
    WITH {REGISTERED},
    due AS (
        SELECT k.id, r.lock_timeout
        FROM idempotency_keys AS k
        JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
        WHERE {_DUE}
          AND {lease_free("r.lock_timeout")}
        ORDER BY k.next_attempt_at
        LIMIT :batch_size
        FOR UPDATE OF k SKIP LOCKED
    )
    UPDATE idempotency_keys AS k
    SET locked_at = now(), lock_token = :token, lock_timeout = due.lock_timeout
    FROM due
    WHERE k.id = due.id
    RETURNING k.id, k.operation, k.operation_version, k.attempts
    """
)

# Due keys no registered operation can resume, per operation and version: read only.
_UNREGISTERED = text(
    f"""
    WITH {REGISTERED}
    SELECT k.operation, k.operation_version, count(*) AS keys
    FROM idempotency_keys AS k
    WHERE {_DUE}
      AND NOT EXISTS (SELECT 1 FROM registered AS r
                      WHERE r.operation = k.operation AND r.version = k.operation_version)
    GROUP BY k.operation, k.operation_version
    ORDER BY k.operation, k.operation_version
    """
)

# Hand back leases taken but not used (the completer is stopping); no attempt is counted.
_RELEASE_UNSTARTED = text(
    """
    UPDATE idempotency_keys SET locked_at = NULL, lock_token = NULL
    WHERE id = ANY(CAST(:ids AS bigint[])) AND lock_token = :token
    """
)


@dataclass
class CompleterResult(Result):
    finished: int = 0
    """Keys resumed to a stored response."""
    failed: int = 0
    """Attempts a phase failed; the key backs off (or is abandoned)."""
    abandoned: int = 0
    """Keys given up after ``max_attempts``."""
    skipped: int = 0
    """Keys a client took over between the claim and the resume."""
    unregistered: int = 0
    """Due keys of operations (or versions) this engine does not have; left alone."""
    errors: int = 0
    """Keys, and operations' claims, that failed in an unexpected way; each is logged."""


@dataclass(frozen=True)
class _Claimed:
    id: int
    operation: str
    operation_version: int
    attempts: int


class Completer(Worker[CompleterResult]):
    """Resumes unfinished keys in-process and abandons those out of attempts.

    Parameters
    ----------
    min_age:
        Seconds an unfinished key waits after its last run for its own client to retry
        before the completer takes it; 0 takes keys as soon as they are due.
    """

    name: ClassVar[str] = "completer"
    default_batch_size: ClassVar[int] = 10
    default_interval: ClassVar[float] = 5.0

    def __init__(
        self,
        engine: Engine,
        *,
        batch_size: int | None = None,
        min_age: float = 60.0,
        stop_event: threading.Event | None = None,
    ) -> None:
        super().__init__(engine, batch_size=batch_size, stop_event=stop_event)
        if min_age < 0:
            raise ValueError(f"completer: min_age must be >= 0, got {min_age}")
        self.min_age = min_age
        self._reported: dict[tuple[str, int], int] = {}

    def run_once(self) -> CompleterResult:
        result = CompleterResult()
        operations = list(self.engine.operations)
        with self.db.connect() as conn:
            result.unregistered = self._report_unregistered(conn, self._registered(operations))
        while not self.stopping:
            token = uuid.uuid4()
            batch, operations = self._claim(operations, token, result)
            result.batches += 1
            done = 0
            try:
                for key in batch:
                    if self.stopping:
                        break
                    self._complete(key, token, result)
                    done += 1
            finally:
                # Stopping, or an error out of the loop: keys not started go back at once
                # instead of waiting out their leases.
                if done < len(batch):
                    self._release([k.id for k in batch[done:]], token)
            if self.stopping or len(batch) < self.batch_size:
                break
        self.engine.observer.worker_pass(self.name)
        return result

    def _registered(self, operations: list[Operation[Any]]) -> dict[str, Any]:
        return {
            "operations": [op.name for op in operations],
            "versions": [op.version for op in operations],
            "lock_timeouts": [op.lock_timeout.total_seconds() for op in operations],
            "min_age": self.min_age,
        }

    def _claim(
        self, operations: list[Operation[Any]], token: uuid.UUID, result: CompleterResult
    ) -> tuple[list[_Claimed], list[Operation[Any]]]:
        """A batch of due keys of ``operations``, and the operations left for the pass.

        One statement claims for every operation. Should it fail, each operation claims on
        its own, and those whose claim fails sit the rest of the pass out, logged: one
        operation's keys must not stall the others'. When every one fails (the database is
        down, say) the error ends the pass.
        """
        try:
            return self._claim_due(operations, token, self.batch_size), operations
        except Exception:
            if len(operations) < 2:
                raise
        batch: list[_Claimed] = []
        healthy: list[Operation[Any]] = []
        error: Exception | None = None
        for operation in operations:
            room = self.batch_size - len(batch)
            try:
                # With no room left, the next combined claim tells whether it fails too.
                batch += self._claim_due([operation], token, room) if room else []
            except Exception as exc:
                error = exc
                result.errors += 1
                self.log_error(
                    "claim_failed", exc, operation=operation.name, version=operation.version
                )
            else:
                healthy.append(operation)
        if error is not None and not healthy:
            raise error
        return batch, healthy

    def _claim_due(
        self, operations: list[Operation[Any]], token: uuid.UUID, limit: int
    ) -> list[_Claimed]:
        """Take the leases of up to ``limit`` due keys of ``operations``, in one transaction."""
        params = {**self._registered(operations), "batch_size": limit, "token": token}
        with self.db.begin() as conn:
            return [_Claimed(*row) for row in conn.execute(_CLAIM_DUE, params)]

    def _complete(self, key: _Claimed, token: uuid.UUID, result: CompleterResult) -> None:
        """Resume one key; whatever goes wrong with it stays with it."""
        try:
            self._resume(key, token, result)
        except Exception as exc:
            # Not a phase's failure (the engine counts those) but one here: abandoning the
            # key failed, say. The key keeps the lease this pass took (unless the engine
            # gave it up), so it is tried again once that expires, not on every pass.
            result.errors += 1
            self.log_error(
                "key_failed",
                exc,
                key_id=key.id,
                operation=key.operation,
                version=key.operation_version,
            )

    def _resume(self, key: _Claimed, token: uuid.UUID, result: CompleterResult) -> None:
        operation = self.engine.operation(key.operation, key.operation_version)
        if key.attempts >= operation.max_attempts:
            # Out of attempts already (its client's): abandon it without another run.
            result.abandoned += self._abandon(key.id, operation, token)
            return
        try:
            outcome = self.engine.resume(key.id, token=token)
        except (KeyInUse, LockLost):
            result.skipped += 1
        except Exception:
            # The engine released the lease, counted the attempt and logged the error.
            result.failed += 1
            result.abandoned += self._abandon(key.id, operation, token)
        else:
            if outcome.replayed:
                result.skipped += 1
            else:
                result.finished += 1

    def _abandon(self, key_id: int, operation: Operation[Any], token: uuid.UUID) -> int:
        """Abandon the key if it is out of attempts; 1 if it was, else 0."""
        row = abandon_exhausted(
            self.db,
            key_id,
            token,
            operation.max_attempts,
            ABANDONED_RESPONSE.status,
            ABANDONED_RESPONSE.body,
        )
        if row is None:
            return 0
        self.engine.observer.key_abandoned(operation.name)
        self.log(
            logging.ERROR,
            "abandoned",
            key_id=key_id,
            operation=operation.name,
            version=operation.version,
            idempotency_key=row.idempotency_key,
            recovery_point=row.recovery_point,
            attempts=row.attempts,
            last_error=row.last_error,
        )
        return 1

    def _release(self, ids: list[int], token: uuid.UUID) -> None:
        with self.db.begin() as conn:
            conn.execute(_RELEASE_UNSTARTED, {"ids": ids, "token": token})

    def _report_unregistered(self, conn: Connection, registered: dict[str, Any]) -> int:
        """Count due keys no registered operation can resume; log when the picture changes."""
        found = {
            (row.operation, row.operation_version): row.keys
            for row in conn.execute(_UNREGISTERED, registered)
        }
        if found != self._reported:
            for (name, version), keys in found.items():
                self.log(
                    logging.WARNING,
                    "unregistered",
                    operation=name,
                    version=version,
                    keys=keys,
                    hint="register this operation version with the engine to complete them",
                )
            self._reported = found
        return sum(found.values())
