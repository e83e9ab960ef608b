"""The completer: finishes keys their clients left unfinished.

It reserves due keys in small batches (``FOR UPDATE SKIP LOCKED``, so completers never wait
for or collide with one another) under one fencing token, then resumes each with that token
through the engine that registered its operation: :meth:`Engine.resume` one key after
another, :meth:`AsyncEngine.resume` on an event loop of the completer's own, the batch's
keys all at once (each has its own lease, row and connection), except those whose last
holder died without releasing their lease: each of those is resumed alone, first, so that a
poison key that kills the completer again costs no other key an attempt. A reservation is a short
lease (:attr:`Completer.reservation`): a key's resume takes its full lease and counts the
attempt, so a completer that dies mid-batch (a poison key that kills its process) holds the
keys it had not resumed for seconds, not for their lock timeout, and counts no attempt for
them. The claim of each attempt also schedules the next with exponential backoff and
jitter (``retry_base=…, retry_cap=…``), so a key whose attempt killed the completer is
backed off like one that failed. Once a key has counted ``max_attempts`` attempts (the
operation's), it is abandoned: finished with :data:`ABANDONED_RESPONSE`, which a retrying
client gets replayed, and reported in one log line. An abandoned key's compensation, when
its operation declares one, runs at the end of a pass
(:mod:`recoverypoint.workers.compensator`), whoever abandoned the key.

Only keys of operations registered with the engine, at the stored version, are claimed;
others are never locked or written, but counted and reported: as another running
completer's to finish, or as keys no worker can finish, an error
(:mod:`recoverypoint.workers.unregistered`).

One operation, or one key, that fails in a way nobody planned for never stalls the
others: when the claim fails, each operation claims on its own and only those whose claim
fails sit the pass out; an error with one key is logged and counted, and the pass goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import TextClause, text

from ..admin.key_actions import abandon_exhausted
from ..engine import ABANDONED_RESPONSE, Engine
from ..errors import DatabaseUnavailable, KeyInUse, LockLost, NeedsReconciliation
from ..leases import REGISTERED, free, from_now, registered
from ..observe import Observer
from ..operation import Operation, Outcome
from ..outage import is_outage
from . import compensator
from .compensator import Compensator, run_on
from .engines import AnyEngine
from .loop import EVERY_SCOPE, IN_SCOPE, Result, Rows, Worker, registered_scopes
from .unregistered import Unregistered, listing

# A key whose client has had :min_age seconds since its last run to come back on its own,
# or that an operator retried since (keys retry): the operator has decided for the client.
# Never NULL (a key never retried has no retried_at), as it is negated below.
_CLIENTS_TIME_OVER = """
    (k.last_run_at <= now() - make_interval(secs => :min_age)
     OR coalesce(k.retried_at > k.last_run_at, false))
"""

# An unfinished key whose next attempt is due and whose client's time is over. Never one
# held for an operator's reconciliation (its next attempt never comes either: said twice,
# as it matters).
_DUE = f"""
    k.finished_at IS NULL
    AND k.reconcile_since IS NULL
    AND k.next_attempt_at <= now()
    AND {_CLIENTS_TIME_OVER}
"""

# The scopes with due keys of registered operations whose lease is free, longest due first:
# where the keys are distributed, a batch is claimed scope by scope, in this order.
_DUE_SCOPES = registered_scopes(_DUE, "k.next_attempt_at")


def _claim_due(rows: Rows) -> TextClause:
    """Reserve a batch of due keys, of ``:scope`` or of every scope (see
    :class:`.loop.Rows`), with a free or expired lease, under one token. SKIP LOCKED: rows
    another completer (or a client's claim) holds are passed over. The reservation is a
    lease that runs out :reservation seconds from now (taken as if that much less than the
    lock timeout remained, so that every reader of the lease rule agrees), stored with the
    version's lock timeout as every lease is; the resume of each key renews it in full. A
    key whose lease was still set (its last holder died without releasing it) is returned
    as unreleased. Returned longest due first, the order the keys resumed one by one are
    resumed in: a key whose attempt killed the process was backed off by its claim, so the
    keys due before it are resumed before it is."""
    return text(
        f"""
    WITH {REGISTERED},
    due AS (
        SELECT k.id{rows.chosen("k")}, r.lock_timeout, k.locked_at IS NOT NULL AS unreleased
        FROM idempotency_keys AS k
        JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
        WHERE {rows.only}{_DUE}
          AND {free("r.lock_timeout")}
        ORDER BY k.next_attempt_at
        LIMIT :batch_size
        FOR UPDATE OF k SKIP LOCKED
    ),
    reserved AS (
        UPDATE idempotency_keys AS k
        SET locked_at = {from_now("least(due.lock_timeout, :reservation) - due.lock_timeout")},
            lock_token = :token, lock_timeout = due.lock_timeout
        FROM due
        WHERE {rows.same("k", "due")} AND k.id = due.id
        RETURNING k.id, k.scope, k.operation, k.operation_version, k.attempts,
                  due.unreleased, k.next_attempt_at
    )
    SELECT id, scope, operation, operation_version, attempts, unreleased FROM reserved
    ORDER BY next_attempt_at
    """
    )


_CLAIM_IN_SCOPE, _CLAIM_EVERY_SCOPE = _claim_due(IN_SCOPE), _claim_due(EVERY_SCOPE)

# Due keys, and abandoned ones awaiting a compensation, that no registered operation can
# resume, per operation and version: read only.
_UNREGISTERED = listing(_DUE, compensator.DUE)

# Unfinished keys of registered operations a pass left alone, by why (as _DUE and the
# claim's lease rule decide): read only, after the pass, so that what it took is not counted.
_HELD_BACK = text(
    f"""
    WITH {REGISTERED}
    SELECT
        count(*) FILTER (WHERE k.next_attempt_at > now()) AS backing_off,
        count(*) FILTER (WHERE k.next_attempt_at <= now() AND NOT {_CLIENTS_TIME_OVER})
            AS too_recent,
        count(*) FILTER (WHERE k.next_attempt_at <= now() AND {_CLIENTS_TIME_OVER}
                           AND NOT {free("r.lock_timeout")}) AS leased
    FROM idempotency_keys AS k
    JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
    WHERE k.finished_at IS NULL
    """
)

# Hand back leases taken but not used (the completer is stopping); no attempt is counted.
_RELEASE_UNSTARTED = text(
    """
    UPDATE idempotency_keys SET locked_at = NULL, lock_token = NULL
    WHERE scope = :scope AND id = ANY(CAST(:ids AS bigint[])) AND lock_token = :token
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
    held: int = 0
    """Keys found past a foreign step's dedupe window with no reconcile hook: held for an
    operator's reconciliation, never resumed again until then."""
    unregistered: int = 0
    """Due keys, and abandoned keys awaiting a compensation, of operations (or versions)
    this engine does not have; left alone."""
    unfinishable: int = 0
    """Those of :attr:`unregistered` unfinished, whose version no running completer
    registers: no worker can finish them (an error; ``--once`` fails). Abandoned keys
    awaiting such a version's compensation are not counted: a retired version's may owe
    none (a warning)."""
    errors: int = 0
    """Keys, and operations' claims, that failed in an unexpected way; each is logged."""
    too_recent: int = 0
    """Due keys left alone, their last run younger than ``min_age``: their own clients
    may still retry them."""
    backing_off: int = 0
    """Unfinished keys left alone, their next attempt not due yet (after a failed one)."""
    leased: int = 0
    """Due keys left alone, a live request holding their lease."""
    compensated: int = 0
    """Abandoned keys whose operation's compensation committed."""
    compensation_failed: int = 0
    """Compensations that raised; each is logged and tried again on a later pass."""

    _not_work: ClassVar[tuple[str, ...]] = ("batches", "too_recent", "backing_off", "leased")

    @property
    def stranded(self) -> int:
        return self.unfinishable


@dataclass(frozen=True)
class _Claimed:
    id: int
    scope: str
    operation: str
    operation_version: int
    attempts: int
    unreleased: bool
    """Its lease was still set when reserved: its last attempt's holder died (a poison key,
    perhaps, or a completer that died with it in its batch)."""


class Completer(Worker[CompleterResult]):
    """Resumes unfinished keys in-process and abandons those out of attempts.

    An :class:`AsyncEngine`'s keys are resumed on an event loop the completer runs in its
    own thread, with the engine's connection pool: run the completer in a process (or a
    thread) of its own, never from a coroutine, and keep ``batch_size`` within the pool,
    since a batch's async resumes run at once. :meth:`close` closes the loop;
    :meth:`run_forever` does so as it returns.

    Parameters
    ----------
    min_age:
        Seconds an unfinished key waits after its last run for its own client to retry
        before the completer takes it; 0 takes keys as soon as they are due. A key an
        operator retried since its last run (``recoverypoint keys retry``) is taken at
        once: the operator has decided for its client.
    """

    name: ClassVar[str] = "completer"
    default_batch_size: ClassVar[int] = 10
    default_interval: ClassVar[float] = 5.0
    reservation: ClassVar[float] = 30.0
    """Seconds a batch's keys stay reserved for this completer before each is resumed
    (its resume then takes the full lease): past it, a key the completer has not got to
    (its process died, or the keys before it took long) is free for another completer or
    its client. Capped by each operation's lock timeout."""

    def __init__(
        self,
        engine: AnyEngine | Sequence[AnyEngine],
        *,
        batch_size: int | None = None,
        min_age: float = 60.0,
        stop_event: threading.Event | None = None,
        app: Sequence[str] = (),
    ) -> None:
        super().__init__(engine, batch_size=batch_size, stop_event=stop_event, app=app)
        if min_age < 0:
            raise ValueError(f"completer: min_age must be >= 0, got {min_age}")
        self.min_age = min_age
        self._unregistered = Unregistered(self, _UNREGISTERED)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._compensator = Compensator(self, run_on(self._event_loop))

    def run_once(self) -> CompleterResult:
        result = CompleterResult()
        operations = list(self.engines.operations)
        registered = self._registered(operations)
        with self.db.begin() as conn:
            self._unregistered.record(conn, registered)
            result.unregistered, result.unfinishable = self._unregistered.report(conn, registered)

        def batch() -> int:
            nonlocal operations  # those whose claim failed sit the rest of the pass out
            token = uuid.uuid4()
            claimed, operations = self._claim(operations, token, result)
            result.batches += 1
            done: set[int] = set()
            try:
                self._complete_batch(claimed, token, result, done)
            finally:
                # Stopping, or an error out of the batch: keys not done go back at once
                # instead of waiting out their leases.
                if len(done) < len(claimed):
                    self._release([k for k in claimed if k.id not in done], token)
            return len(claimed)

        self.in_batches(batch)
        self._count_held_back(operations, result)
        result.compensated, result.compensation_failed = self._compensator.run_once()
        self.engines.observer.worker_pass(self.name)
        return result

    def _count_held_back(self, operations: list[Operation[Any]], result: CompleterResult) -> None:
        """Why the keys the pass left unfinished were left: an operator running one pass
        by hand is told, rather than seeing nothing done."""
        with self.db.connect() as conn:
            row = conn.execute(_HELD_BACK, self._registered(operations)).one()
        result.backing_off, result.too_recent, result.leased = row

    def run_forever(self, interval: float | None = None, jitter: float | None = None) -> None:
        try:
            super().run_forever(interval, jitter)
        finally:
            self.close()

    def close(self) -> None:
        """Close the event loop the async resumes ran on; the next pass opens another. A
        loop still running (in :meth:`run_forever`'s thread) is closed there, as it ends."""
        loop = self._loop
        if loop is None or loop.is_running():
            return
        self._loop = None
        if not loop.is_closed():
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def _complete_batch(
        self, batch: list[_Claimed], token: uuid.UUID, result: CompleterResult, done: set[int]
    ) -> None:
        """Resume the batch's keys one by one, checking for a stop between them: those of
        sync operations, and those of async operations whose last holder died (on the
        completer's loop); then the other keys of async operations at once.

        A key whose last attempt died with its process may kill the completer too: resumed
        alone, it costs only itself an attempt, not each neighbour that would have been
        running beside it (each of those counted one at its claim)."""
        together: list[_Claimed] = []
        for key in batch:
            if self.stopping:
                return
            if not self.engines.runs_async(key.operation, key.operation_version):
                self._complete(key, token, result)
            elif key.unreleased:
                self._event_loop().run_until_complete(self._complete_async(key, token, result))
            else:
                together.append(key)
                continue
            done.add(key.id)
        if together and not self.stopping:
            self._event_loop().run_until_complete(self._complete_all(together, token, result, done))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the async engines' work runs on, made on first use."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    async def _complete_all(
        self, keys: list[_Claimed], token: uuid.UUID, result: CompleterResult, done: set[int]
    ) -> None:
        async def complete(key: _Claimed) -> None:
            await self._complete_async(key, token, result)
            done.add(key.id)

        await asyncio.gather(*(complete(key) for key in keys))

    def _registered(self, operations: list[Operation[Any]]) -> dict[str, Any]:
        return {**registered(operations), "min_age": self.min_age}

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
        except Exception as exc:
            if len(operations) < 2 or is_outage(exc):  # the database is down for them all
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
        """Take the leases of up to ``limit`` due keys of ``operations``: of every scope in
        one transaction, or where the keys are distributed, one transaction per scope."""
        params = {**self._registered(operations), "token": token, "reservation": self.reservation}
        if not self.distributed:
            with self.db.begin() as conn:
                rows = conn.execute(_CLAIM_EVERY_SCOPE, {**params, "batch_size": limit})
                return [_Claimed(*row) for row in rows]
        claimed: list[_Claimed] = []
        for scope in self.scopes_due(_DUE_SCOPES, params):
            if len(claimed) == limit or self.stopping:
                break
            room = {**params, "scope": scope, "batch_size": limit - len(claimed)}
            with self.db.begin() as conn:
                claimed += [_Claimed(*row) for row in conn.execute(_CLAIM_IN_SCOPE, room)]
        return claimed

    def _complete(self, key: _Claimed, token: uuid.UUID, result: CompleterResult) -> None:
        """Resume one key of a sync operation; whatever goes wrong with it stays with it."""
        try:
            engine, operation = self.engines.owner(key.operation, key.operation_version, Engine)
            if self._exhausted(key, engine.observer, operation, token, result):
                return
            try:
                outcome = engine.resume(key.id, scope=key.scope, token=token)
            except Exception as exc:
                self._failed(exc, key, engine.observer, operation, token, result)
            else:
                self._resumed(outcome, result)
        except Exception as exc:
            self._key_failed(key, exc, result)

    async def _complete_async(
        self, key: _Claimed, token: uuid.UUID, result: CompleterResult
    ) -> None:
        """Resume one key of an async operation: as :meth:`_complete`, with the sync
        statements in a thread so that the other keys' resumes go on meanwhile."""
        # The threads of the batch's keys run at once: each counts into a result of its
        # own, added to the pass's here on the loop (``+=`` from two threads can lose one).
        own = CompleterResult()
        from ..engine.run_async import AsyncEngine  # imported already: the key's engine is one

        try:
            engine, operation = self.engines.owner(
                key.operation, key.operation_version, AsyncEngine
            )
            args = (engine.observer, operation, token, own)
            if await asyncio.to_thread(self._exhausted, key, *args):
                return
            try:
                outcome = await engine.resume(key.id, scope=key.scope, token=token)
            except Exception as exc:
                await asyncio.to_thread(self._failed, exc, key, *args)
            else:
                self._resumed(outcome, own)
        except Exception as exc:
            self._key_failed(key, exc, own)
        finally:
            result.add(own)

    def _exhausted(
        self,
        key: _Claimed,
        observer: Observer,
        operation: Operation[Any],
        token: uuid.UUID,
        result: CompleterResult,
    ) -> bool:
        """Abandon a key out of attempts already (its clients', or runs that died) without
        another run."""
        if key.attempts < operation.max_attempts:
            return False
        result.abandoned += self._abandon(key, observer, operation, token)
        return True

    def _failed(
        self,
        exc: Exception,
        key: _Claimed,
        observer: Observer,
        operation: Operation[Any],
        token: uuid.UUID,
        result: CompleterResult,
    ) -> None:
        """Count a resume that raised; abandon the key if that was its last attempt."""
        if isinstance(exc, NeedsReconciliation):
            result.held += 1  # not a failure, and never abandoned: an operator decides
            return
        if isinstance(exc, (KeyInUse, LockLost, DatabaseUnavailable)):
            # Not an attempt that failed: another holder, or the database away (the key's
            # lease runs out, and a later pass tries again).
            result.skipped += 1
            return
        # The engine released the lease and logged the error; the attempt was counted when
        # the resume claimed the key.
        result.failed += 1
        result.abandoned += self._abandon(key, observer, operation, token)

    @staticmethod
    def _resumed(outcome: Outcome, result: CompleterResult) -> None:
        if outcome.replayed:
            result.skipped += 1
        else:
            result.finished += 1

    def _key_failed(self, key: _Claimed, exc: Exception, result: CompleterResult) -> None:
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

    def _abandon(
        self, key: _Claimed, observer: Observer, operation: Operation[Any], token: uuid.UUID
    ) -> int:
        """Abandon the key if it is out of attempts; 1 if it was, else 0."""
        row = abandon_exhausted(
            self.db,
            key.scope,
            key.id,
            token,
            operation.max_attempts,
            ABANDONED_RESPONSE.status,
            ABANDONED_RESPONSE.body,
        )
        if row is None:
            return 0
        observer.key_abandoned(operation.name)
        self.log(
            logging.ERROR,
            "abandoned",
            key_id=key.id,
            operation=operation.name,
            version=operation.version,
            idempotency_key=row.idempotency_key,
            recovery_point=row.recovery_point,
            attempts=row.attempts,
            last_error=row.last_error,
        )
        return 1

    def _release(self, keys: list[_Claimed], token: uuid.UUID) -> None:
        """Hand the leases of ``keys`` back, one statement per scope."""
        by_scope: dict[str, list[int]] = {}
        for key in keys:
            by_scope.setdefault(key.scope, []).append(key.id)
        with self.db.begin() as conn:
            for scope, ids in by_scope.items():
                conn.execute(_RELEASE_UNSTARTED, {"scope": scope, "ids": ids, "token": token})
