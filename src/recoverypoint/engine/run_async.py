"""The engine: claim a key, run its phases from the recovery point, replay what finished.

A request, top to bottom: :meth:`AsyncEngine.run` validates it and claims its key in one
SERIALIZABLE transaction (:meth:`AsyncEngine._claim`; a new key runs its first atomic phase
in that transaction too); :meth:`AsyncEngine._drive` then runs the phases after the
recovery point, one :meth:`_AsyncRun.next` each: an atomic phase in a transaction of its
own that locks the key row first (:meth:`_AsyncRun.fenced`; a phase that sends no
statement, with the write that records it) and COMMITs with its recovery point
(:meth:`_AsyncRun._commit`), a foreign step outside any transaction. The claim that
takes the lease counts the attempt, so a process that dies mid-step has used one; a key out
of attempts is abandoned by the claim that would start one more. A failure gives the lease
up and records the error (:meth:`AsyncEngine._give_up`); so does a cancelled request, whose
cleanup the cancellation cannot interrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from sqlalchemy.engine import URL

from .. import _pooler, backoff
from .._faults import faults
from ..database import POOL_ORDER, create_engine, normalize_url
from ..errors import (
    ConfigurationError,
    DeclarationError,
    IdempotencyError,
    KeyInUse,
    LockLost,
    NeedsReconciliation,
)
from ..jobs import JobBackend
from ..keys import (
    DEFAULT_MAX_PARAMS_BYTES,
    canonical_json,
    is_http_status,
    safe_headers,
    validate_namespace,
)
from ..observe import (
    CLIENT,
    COMPLETER,
    NO_OBSERVER,
    NO_RUN,
    Observer,
    RunObservation,
    isolated,
)
from ..operation import (
    STARTED,
    NotFound,
    Operation,
    Outcome,
    Phase,
    RecoveryPoint,
    Request,
    Response,
    Withdrawn,
)
from ..outage import is_outage, unavailable
from . import _pg_async, heartbeat, listen_async, phase_guard, sql, store_async, waits
from ._decide import (
    ABANDONED_RESPONSE,
    NO_CONTENT,
    Advanced,
    ClaimRequest,
    KeyId,
    KeyRecord,
    KeyRef,
    Progress,
    Registry,
    Requested,
    Step,
    as_answered,
    claim_request,
    dump_state,
    left_scope,
    replay,
    step_result,
)
from ._pg_async import AsyncTransaction
from .context import AsyncAtomicContext, KeyIdentity, StagedJob, StepContext

logger = logging.getLogger("recoverypoint")

# What the driver and the pool raise; each is told apart by outage.is_outage.
_DRIVER_ERRORS = (psycopg.Error, sa.exc.SQLAlchemyError)

T = TypeVar("T")
if TYPE_CHECKING:  # the arguments a unit of work is passed, typed; nothing at run time
    from typing_extensions import TypeVarTuple, Unpack

    Ts = TypeVarTuple("Ts")


class AsyncEngine(Registry):
    """Runs registered operations against PostgreSQL.

    Parameters
    ----------
    database:
        A URL (``postgresql://``, ``postgres://`` or ``postgresql+psycopg://``; always run
        on psycopg 3) or an existing SQLAlchemy engine (``sa_async.AsyncEngine``) on psycopg 3.
    max_params_bytes:
        Largest canonical params accepted; larger ones raise :class:`RequestTooLarge`.
    serialization_retries:
        In-process retries of a transaction that hit a serialization failure or deadlock
        before :class:`ConcurrentUpdate` (409) is raised.
    retry_base:
        Seconds: the backoff after a key's first failed attempt before the completer may
        retry it (half of it fixed, half random); it doubles with each failed attempt.
    retry_cap:
        Seconds: the longest the backoff grows to.
    jobs:
        Where the enqueuer publishes staged jobs, e.g. :class:`~recoverypoint.jobs.InProcessBackend`
        or :class:`~recoverypoint.integrations.celery.CeleryBackend`; also settable later
        as ``engine.jobs``. The workers find everything they need on the engine.
    observer:
        Hears of every run, phase, retry and staged job, and of the workers' work (see
        :mod:`recoverypoint.observe`): the Prometheus and OpenTelemetry integrations, or
        your own; several at once with :func:`recoverypoint.observe.combine`. It is
        called in isolation (:func:`recoverypoint.observe.isolated`): what it raises is
        logged and never changes an outcome.
    namespace:
        What sets this database's derived keys (downstream keys, job keys) apart from any
        other's that shares a foreign account with it. By default the one migration 0009
        made at random in the database, which replicates with it (read on first use); set
        it to keep deriving the same keys in a database restored or rebuilt from scratch.
        Keys already claimed keep the keys they were derived with.
    prepared_statements:
        Whether statements are prepared on the database's connections (the sync engine's
        own, and those psycopg prepares as they recur). ``None``, the default: yes, unless
        a connection reaches PostgreSQL through a pooler, where a transaction may run on
        another server connection than the last (PgBouncer before 1.21 loses them).
        ``True``: yes, for PgBouncer 1.21 on with ``max_prepared_statements`` set, which
        keeps them (unnamed statements cost the server a parse and a plan each time).
        ``False``: never.
    """

    db: sa.Engine
    """The sync engine on the database: the request path's own for rp.Engine; for
    rp.AsyncEngine, the workers', the admin layer's and migrations'."""

    def __init__(
        self,
        database: str | URL | sa_async.AsyncEngine,
        *,
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
        serialization_retries: int = 10,
        retry_base: float = 2.0,
        retry_cap: float = 3600.0,
        jobs: JobBackend | None = None,
        observer: Observer | None = None,
        namespace: str | None = None,
        prepared_statements: bool | None = None,
    ) -> None:
        if True:  # ASYNC
            super().__init__(asynchronous=True)
            # The request path runs on a SQLAlchemy async engine (engine.async_db).
            if isinstance(database, sa_async.AsyncEngine):
                self.async_db = database
            else:
                self.async_db = sa_async.create_async_engine(normalize_url(database), **POOL_ORDER)
            driver = self.async_db.dialect.driver
        else:
            super().__init__(asynchronous=False)
            self.db = create_engine(database)
            driver = self.db.dialect.driver
        # Refused before anything is installed on an engine that may be the caller's own.
        if driver not in ("psycopg", "psycopg_async"):
            raise ValueError(
                f"recoverypoint runs on psycopg 3, and this engine uses {driver}: "
                "create it from a postgresql+psycopg:// URL"
            )
        if True:  # ASYNC
            # The workers, the admin layer and migrations are sync: an engine of their own
            # on the same database (it connects only when they use it).
            self.db = create_engine(self.async_db.url.set(drivername="postgresql+psycopg"))
            _pooler.install(self.async_db.sync_engine, prepared_statements)
        _pooler.install(self.db, prepared_statements)  # the workers' and the admin's too
        self._owns_db = not isinstance(database, sa_async.AsyncEngine)
        self.max_params_bytes = max_params_bytes
        self.serialization_retries = serialization_retries
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.jobs = jobs
        self.observer = NO_OBSERVER if observer is None else observer
        self.namespace = None if namespace is None else validate_namespace(namespace)
        self._bound: bool | None = None  # see bound
        self._wait_slots = waits.WaitSlots(waits.MAX_WAITERS)
        self._heartbeat = heartbeat.AsyncHeartbeat(self.db)

    @property
    def observer(self) -> Observer:
        """Hears of the engine's and its workers' work; set it (here or at construction)
        and it is isolated: it may fail, and no outcome changes."""
        return self._observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        self._observer = isolated(observer)

    async def dispose(self) -> None:
        """Close the pooled connections of the engine made from a URL; an engine you passed
        in is yours to dispose."""
        if True:  # ASYNC
            self.db.dispose()  # made here in any case
        if self._owns_db:
            await self.async_db.dispose()

    async def check(self, *operations: Operation[Any]) -> None:
        """Check at start-up what would otherwise fail every request: that the database
        holds recoverypoint's schema at this version's revision (``recoverypoint migrate``
        applied) and that each of ``operations`` is registered. Raises
        :class:`ConfigurationError` (:class:`OperationNotRegistered` is one) naming the fix.
        """
        for operation in operations:
            self.check_registered(operation)
        await self._check_schema()

    async def _check_schema(self) -> None:
        from ..migrate import check_schema  # Alembic: imported only when checking

        if True:  # ASYNC
            await asyncio.to_thread(check_schema, self.db)
        else:
            check_schema(self.db)

    # -- the request path ----------------------------------------------------------------

    async def run(
        self,
        operation: Operation[Any],
        *,
        key: str,
        params: Any,
        scope: str = "",
        request: Request | None = None,
        wait: timedelta | float | None = None,
    ) -> Outcome:
        """Run ``operation`` once per ``(scope, operation, key)``.

        A new key runs every phase; an unfinished key resumes after its recovery point; a
        finished key replays its stored response (``Outcome.replayed``). Raises an
        :class:`IdempotencyError` for bad input (nothing stored), a key in use or reused
        with other params, a database outage (:class:`DatabaseUnavailable`, whatever the
        driver raised), and re-raises what a phase raised once the lease is released.

        ``wait`` (a duration, at most a minute): a call that finds the key in use waits
        that long for the call that holds it, and gets its answer (a replay), or the key
        if that call failed; then :class:`KeyInUse` as without it. See
        :mod:`recoverypoint.engine.waits`.
        """
        seconds = waits.wait_seconds(wait)
        if not seconds:
            return await self._observed_run(operation, key, params, scope, request)
        deadline = time.monotonic() + seconds
        try:
            return await self._observed_run(operation, key, params, scope, request)
        except KeyInUse as exc:
            if not self._wait_slots.take():
                raise  # as many calls wait as an engine lets: answered at once
            refused = exc
        try:
            lock, channel = waits.wake(scope, operation.name, key)
            async with listen_async.listening(self.db, channel, lock) as listener:
                while True:
                    # Claimed again once LISTENing with the lock: a commit before is seen
                    # here, one after it is heard.
                    try:
                        return await self._observed_run(operation, key, params, scope, request)
                    except KeyInUse as exc:
                        refused, left = exc, deadline - time.monotonic()
                        if left <= 0:
                            raise
                    # Woken by the holder's commit, or at its lease's end (it may have died).
                    await listener.heard(min(left, refused.retry_after))
        except waits.CannotWait:
            raise refused from None  # no connection to wait on: answered as without wait
        finally:
            self._wait_slots.give_back()

    async def _observed_run(
        self,
        operation: Operation[Any],
        key: str,
        params: Any,
        scope: str,
        request: Request | None,
    ) -> Outcome:
        observing = self.observer.run(
            operation.name, operation.version, by=CLIENT, scope=scope, key=key
        )
        with observing as observed:
            try:
                outcome = await self._run(observed, operation, key, params, scope, request)
            except _DRIVER_ERRORS as exc:
                if not is_outage(exc):
                    raise
                raise unavailable(exc) from exc
            return observed.finished(outcome)

    async def _run(
        self,
        observed: RunObservation,
        operation: Operation[Any],
        key: str,
        params: Any,
        scope: str,
        request: Request | None,
    ) -> Outcome:
        namespace = self.namespace
        if namespace is None:
            namespace = await self._database_namespace()
        await self._find_binding()
        requested = self.requested(operation, key, scope, request)
        checked = functools.partial(
            claim_request, operation, requested, params, self.max_params_bytes, namespace
        )
        claim = _Claim(operation, requested, checked, params, observed)
        if True:  # ASYNC
            if not _pg_async.idle_connection(self.async_db):
                # The borrow may wait for a connection, or make one: bad input is not kept
                # waiting for it. Otherwise checked while the lookup is on its way.
                claim.check()
        else:
            claim.check()  # before a connection is borrowed: its lookup would hide nothing
        try:
            first = await self._transact(self._claim, claim)
        except _DRIVER_ERRORS:
            # Where the database failed before the params were checked (a connection the
            # outage killed), they are checked now: bad input is the caller's to fix, not a
            # reason to retry, whatever the database did.
            try:
                claim.check()
            except IdempotencyError as refused:
                raise refused from None
            raise
        except Exception:
            raise  # raised before COMMIT: the claim rolled back
        except BaseException as exc:
            # A cancellation (or an interrupt) that lands on COMMIT does not stop it: give
            # the lease up, which does nothing if the claim rolled back after all.
            if claim.run is not None:
                await self._abandon(claim.run, exc, claim)
            raise
        if claim.run is None:  # a finished key: its replay, or the answer it was abandoned with
            assert isinstance(first, Outcome)
            if claim.abandoned is not None:
                self._exhausted(*claim.abandoned)
            return first
        return await self._drive(claim.run, first)

    async def _database_namespace(self) -> str:
        """The namespace migration 0009 stored in the database; read once, then kept."""
        try:
            row = await _pg_async.run_alone(self.async_db, sql.NAMESPACE, {})
        except psycopg.errors.UndefinedTable:
            await self._check_schema()  # raises ConfigurationError: not migrated, or old
            raise
        if row is None:
            raise ConfigurationError(
                "recoverypoint_namespace is empty: run `recoverypoint migrate`, or pass "
                "namespace= to the engine"
            )
        self.namespace = validate_namespace(row[0])
        return self.namespace

    @property
    def bound(self) -> bool:
        """Whether each atomic phase's transaction is bound to its scope's worker (on
        Citus, where ``idempotency_keys`` is distributed): one that writes on another
        worker too then fails with :class:`PhaseLeftScope`, nothing committed."""
        return bool(self._bound)

    async def _find_binding(self) -> None:
        """Find out :attr:`bound` before the first transaction; once, then kept."""
        if self._bound is None:
            self._bound = await store_async.distributed(self.async_db)

    async def resume(
        self, key_id: int, *, scope: str | None = None, token: uuid.UUID | None = None
    ) -> Outcome:
        """Resume the unfinished key record ``key_id`` from its recovery point, in-process,
        with the operation registered under its stored name and version; the completer
        does this for every key it claims.

        A finished key returns its stored response (``replayed=True``). Raises
        :class:`OperationNotRegistered` before touching the key, :class:`KeyInUse` when
        another request holds its lease, :class:`LookupError` when there is no such key,
        and what a phase raised, once the lease is released and the attempt counted.
        ``token`` is a lease the caller already holds on the key; without it the lease is
        taken if it is free or expired. ``scope``: the key's, when the caller knows it (the
        completer does): every statement then reads the one shard that holds the key on a
        distributed database; without it the key is first looked up by id on every shard.
        A database outage raises :class:`DatabaseUnavailable`.
        """
        try:
            return await self._resume(key_id, scope, token)
        except _DRIVER_ERRORS as exc:
            if not is_outage(exc):
                raise
            raise unavailable(exc) from exc

    async def _resume(self, key_id: int, scope: str | None, token: uuid.UUID | None) -> Outcome:
        ident = await store_async.key_operation(self.async_db, key_id, scope)
        if ident is None:
            raise LookupError(f"there is no key record {key_id}")
        name, version, scope = ident
        operation = self.operation(name, version)
        held = token or uuid.uuid4()
        lock_timeout = operation.lock_timeout.total_seconds()  # of the key's own version
        observing = self.observer.run(
            operation.name, operation.version, by=COMPLETER, scope=None, key=None
        )
        await self._find_binding()
        with observing as observed:
            key = KeyId(scope, key_id, held, lock_timeout, operation.max_attempts)
            claim = _ClaimById(key, self._schedule())
            try:
                record = await self._transact(claim.take)
            except Exception:
                raise  # raised before COMMIT: the claim rolled back
            except BaseException as exc:
                # As in run(): an interrupt that lands on COMMIT does not stop it.
                if claim.taken is not None:
                    await self._abandon(_AsyncRun(self, operation, claim.taken, held), exc)
                raise
            if record is None:
                raise LookupError(f"key record {key_id} was deleted")
            if record.claimed:
                run = _AsyncRun(self, operation, record, held, observed)
                return observed.finished(await self._drive(run, None))
            if claim.abandoned is not None:
                self._exhausted(operation, record)
                return observed.finished(claim.abandoned)
            if record.response_status is not None:
                return observed.finished(replay(record))
            if record.held:
                raise NeedsReconciliation(f"key record {key_id} waits for reconciliation")
            lease_left = record.lease_left(lock_timeout)
            raise KeyInUse(f"key record {key_id} is in use", retry_after=max(1, lease_left))

    async def compensate(self, key_id: int, *, scope: str, token: uuid.UUID) -> bool:
        """Run the compensation of abandoned key ``key_id`` of ``scope``, whose lease the
        caller (the completer) took under ``token``, with the operation registered under
        its stored name and version: in one SERIALIZABLE transaction that locks the key,
        runs :meth:`Operation.compensation`, and commits ``compensated_at``, the state it
        left, its staged jobs and the lease's release together.

        ``False`` when the key no longer awaits it under ``token`` (compensated, reopened,
        its lease taken over): nothing ran. Raises :class:`OperationNotRegistered`, or
        :class:`DeclarationError` when the operation declares no compensation, and what
        the compensation raised, with nothing committed (the lease is still the caller's).
        """
        ident = await store_async.key_operation(self.async_db, key_id, scope)
        if ident is None:
            return False
        operation = self.operation(ident[0], ident[1])
        phase = operation.compensation_phase
        if phase is None:
            raise DeclarationError(
                f"{operation.name} v{operation.version} declares no compensation: "
                "abandoned keys of it are left to a human"
            )
        await self._find_binding()
        try:
            return await self._transact(self._compensate, operation, phase, key_id, scope, token)
        except _DRIVER_ERRORS as exc:
            if not is_outage(exc):
                raise
            raise unavailable(exc) from exc

    async def _compensate(
        self,
        tx: AsyncTransaction,
        operation: Operation[Any],
        phase: Phase,
        key_id: int,
        scope: str,
        token: uuid.UUID,
    ) -> bool:
        """The compensation's transaction: fence, run, commit; ``False`` if the fence missed."""
        record = await store_async.fence_abandoned(tx, scope, key_id, token)
        if record is None:
            return False
        run = _AsyncRun(self, operation, record, token)
        run.key.locked_by = tx
        if self.bound:
            await store_async.bind(tx, run.key)
        await run.compensate(tx, phase)
        return True

    async def _claim(self, tx: AsyncTransaction, claim: _Claim) -> Step | None:
        """The claim's transaction; a new key runs its first atomic phase in it too, so a
        new request costs one commit less and leaves nothing behind if that phase fails.
        A finished key is looked up first, alone: a replay costs one round trip.

        Returns a finished key's replay (``claim.run`` stays ``None``), or, once the claim
        took the lease (``claim.run`` set), what its first atomic phase reached, if it ran
        one here."""
        # An attempt run again after a serialization failure starts over.
        claim.run = claim.abandoned = None
        operation, params = claim.operation, claim.params
        honoured_for = operation.honoured_for.total_seconds()
        finished, generation = await store_async.finished_key(
            tx, claim.requested, honoured_for, bound=self.bound, meanwhile=claim.check
        )
        request = claim.request
        if finished is not None and finished.expired:
            # Past its retention a key is a new request, whether or not it was reaped.
            await store_async.forget_expired(tx, request, honoured_for, generation)
        elif finished is not None:
            self.judge(operation, request, params, finished)
            return replay(finished)
        record = await store_async.claim(
            tx, request, claim.token, generation, self._schedule(), bound=self.bound
        )
        if record is None:
            # The row was deleted between the conflict and the read: a reaper raced us.
            raise KeyInUse(key=request.key, retry_after=1)
        if not record.inserted:
            # A key is judged by the version that started it: its params rules, its lease.
            operation = self.judge(operation, request, params, record)
            if record.response_status is not None:  # it finished since the lookup
                return replay(record)
            if record.held:  # for an operator: no step is called, whoever asks
                raise NeedsReconciliation(key=request.key)
            lock_timeout = operation.lock_timeout.total_seconds()
            lease_left = record.lease_left(lock_timeout)
            if lease_left > 0:
                raise KeyInUse(key=request.key, retry_after=lease_left)
            # An unfinished key whose lease is free or expired: take it over, unless it is
            # out of attempts (however they ended: a crash counts), which abandons it.
            key = KeyId(record.scope, record.id, claim.token, lock_timeout, operation.max_attempts)
            if record.exhausted(operation.max_attempts):
                abandoned = await _abandon_exhausted(tx, key)
                if abandoned is None:
                    raise KeyInUse(key=request.key, retry_after=1)
                claim.abandoned = (operation, record)
                return abandoned
            taken = await store_async.claim_by_id(tx, key, self._schedule())
            if taken is None or not taken.claimed:
                lease_left = 1 if taken is None else max(1, taken.lease_left(lock_timeout))
                raise KeyInUse(key=request.key, retry_after=lease_left)
            record = taken
        run = claim.run = _AsyncRun(self, operation, record, claim.token, claim.observed)
        if record.inserted and operation.phases[0].atomic:
            store_async.held(tx, run.key, record)  # and bound, by the claim's trigger on Citus
            with claim.observed.phase(operation.phases[0].point, True):
                return await run.atomic(tx, operation.phases[0], "{}")
        return None

    async def _drive(self, run: _AsyncRun, step: Step | None) -> Outcome:
        progress = run.progress
        try:
            while True:
                if step is not None and faults.active:
                    faults.hit("after_commit", progress.committed)
                if isinstance(step, Outcome):
                    return step
                if step is not None:
                    progress.reached(step)
                phase = run.operation.phases[run.operation.next_phase(progress.at)]
                step = await run.next(phase, progress.state)
        except (LockLost, NeedsReconciliation):
            raise  # the lease is someone else's, or was given up holding the key
        except BaseException as exc:
            await self._abandon(run, exc)
            raise

    async def _abandon(
        self, run: _AsyncRun, exc: BaseException, claim: _Claim | None = None
    ) -> None:
        # A cancelled request gives its lease up and counts the attempt all the same.
        await _pg_async.shielded(self._give_up, run, exc, claim)

    async def _give_up(
        self, run: _AsyncRun, exc: BaseException, claim: _Claim | None = None
    ) -> None:
        """Delete the key of a run withdrawn before it recorded anything; otherwise give
        the lease up, keep the recovery point and count the attempt. ``claim``: the claim
        was interrupted at its COMMIT, whose outcome is waited for first."""
        if claim is not None:
            try:
                await self._settle(claim)
            except Exception:
                logger.exception("could not wait for the claim of key %s", run.record.id)
        if isinstance(exc, Withdrawn) and run.progress.committed == STARTED:
            try:
                if await store_async.withdraw(self.async_db, run.key):
                    return
            except Exception:
                logger.exception("could not withdraw key %s", run.record.id)
        error = f"{type(exc).__name__}: {exc}"[:2000]
        # Backed off from now, as the claim scheduled it from its own start; the claim
        # counted this attempt already.
        retry_in = backoff.backoff_delay(
            run.record.attempts - 1, base=self.retry_base, cap=self.retry_cap
        )
        try:
            released = await store_async.release(self.async_db, run.key, error, retry_in)
        except Exception as exc:
            # The lease then simply expires; the original error matters more. An outage
            # is one line per request, not a traceback each.
            if is_outage(exc):
                logger.warning("could not release key %s (the database is away)", run.record.id)
            else:
                logger.exception("could not release key %s after: %s", run.record.id, error)
            return
        logger.warning(
            "key %s of %s failed at %s (lease %s): %s",
            run.record.id,
            run.operation.name,
            run.progress.at,
            "released" if released else "already taken over",
            error,
        )

    async def _settle(self, claim: _Claim) -> None:
        """Wait until the claim of ``claim``, interrupted at its COMMIT, has committed or
        rolled back. Interrupted again, psycopg closes the connection, and the server may
        still be committing: a release sent on another connection meanwhile would find no
        row, and the key would stay leased. The claim is made again, in a transaction rolled
        back: its INSERT waits on the key's unique index for the first one's end."""
        with contextlib.suppress(_Settled):
            await self._transact(_wait_for, claim, self._schedule(), self.bound)

    def _schedule(self) -> dict[str, Any]:
        """When a claim schedules the next attempt should the one it starts fail."""
        return backoff.sql_params(base=self.retry_base, cap=self.retry_cap)

    def _exhausted(self, operation: Operation[Any], record: KeyRecord) -> None:
        """Report a key its claim abandoned, out of attempts, once that claim committed."""
        self.observer.key_abandoned(operation.name)
        logger.error(
            "key %s of %s abandoned at %s after %d attempts (max_attempts=%d): its clients "
            "get the abandoned answer; see its last error, if one was recorded (a process that "
            "died records none), with `recoverypoint keys show %s`; reopen it with "
            "`recoverypoint keys reopen` once the cause is fixed",
            record.id,
            operation.name,
            record.recovery_point,
            record.attempts,
            operation.max_attempts,
            record.id,
        )

    async def _transact(
        self,
        work: Callable[[AsyncTransaction, Unpack[Ts]], Awaitable[T]],
        /,
        *args: Unpack[Ts],
    ) -> T:
        """Run ``work(tx, *args)`` in one SERIALIZABLE transaction, again after a
        serialization failure (see :func:`recoverypoint.engine._pg_async.serializable`).
        A table or column that is not there is a :class:`ConfigurationError` when the
        schema is missing or old (every request would fail the same way); else, the phase
        code's own, it is re-raised as it is."""
        try:
            return await _pg_async.serializable(
                self.async_db, self.serialization_retries, self.observer, work, *args
            )
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
            await self._check_schema()
            raise


class _Claim:
    """What a request's claim (:meth:`AsyncEngine._claim`) works with. The claim is a unit
    of work that a serialization failure runs again, so what it found travels on this
    object, not in its return value: an interrupt may land on its COMMIT after it took the
    lease, and the caller must then give the lease up."""

    __slots__ = (
        "_check",
        "_request",
        "_token",
        "abandoned",
        "observed",
        "operation",
        "params",
        "requested",
        "run",
    )

    def __init__(
        self,
        operation: Operation[Any],
        requested: Requested,
        check: Callable[[], ClaimRequest],
        params: Any,
        observed: RunObservation,
    ) -> None:
        self.operation = operation
        """The operation the request names; the key may be judged by an older version."""
        self.requested = requested
        """The key the request names, checked: what the lookup reads by."""
        self.params = params
        """The params as the caller passed them, for judging a key reused with other ones."""
        self.observed = observed
        """Hears of the claim, and of the first phase when it runs in the claim's transaction."""
        self.run: _AsyncRun | None = None
        """The run, set once the claim took the lease (the transaction may still roll back:
        the caller gives it up if an interrupt lands on COMMIT); ``None`` for a replay."""
        self.abandoned: tuple[Operation[Any], KeyRecord] | None = None
        """The key and the version that started it, when the claim abandoned it (out of
        attempts) instead of taking it."""
        self._check = check
        self._request: ClaimRequest | None = None
        self._token: uuid.UUID | None = None

    def check(self) -> ClaimRequest:
        """The request, its params validated and fingerprinted (:func:`claim_request`);
        raises before anything is stored. Made once: on the async engine while the key's
        lookup is on its way, where the client would otherwise wait for the server; on the
        sync engine before the claim borrows a connection (libpq's blocking call for the
        lookup costs the client less than a send and a wait from Python would, see
        :meth:`recoverypoint.engine._pg.Transaction.lookup`)."""
        if self._request is None:
            self._request = self._check()
        return self._request

    @property
    def request(self) -> ClaimRequest:
        """What the claim writes and compares: the key, the params' fingerprint."""
        return self.check()

    @property
    def token(self) -> uuid.UUID:
        """The lease the claim takes, made when it first writes: a replay takes none. The
        same in every attempt of the claim, and for :meth:`AsyncEngine._settle`."""
        if self._token is None:
            self._token = uuid.uuid4()
        return self._token


class _ClaimById:
    """The claim of :meth:`AsyncEngine.resume`: an unfinished key taken by id, as a unit of
    work that a serialization failure runs again (:meth:`take`)."""

    __slots__ = ("abandoned", "key", "schedule", "taken")

    def __init__(self, key: KeyId, schedule: dict[str, Any]) -> None:
        self.key = key
        self.schedule = schedule
        self.taken: KeyRecord | None = None
        """The record, set once the claim took the lease (the transaction may still roll
        back: the caller gives it up if an interrupt lands on COMMIT)."""
        self.abandoned: Outcome | None = None
        """The answer, when the claim abandoned the key (out of attempts) instead."""

    async def take(self, tx: AsyncTransaction) -> KeyRecord | None:
        """The key's record; it is :attr:`taken` when the claim took its lease."""
        record = await store_async.claim_by_id(tx, self.key, self.schedule)
        self.taken = record if record is not None and record.claimed else None
        self.abandoned = None
        if record is not None and not record.claimed and record.exhausted(self.key.max_attempts):
            self.abandoned = await _abandon_exhausted(tx, self.key)
        return record


async def _abandon_exhausted(tx: AsyncTransaction, key: KeyId) -> Outcome | None:
    """Finish ``key``, out of attempts, with :data:`ABANDONED_RESPONSE`, in ``tx``; its
    answer, or ``None`` when its lease is another's."""
    body = canonical_json(ABANDONED_RESPONSE.body)
    stored = await store_async.abandon_exhausted(tx, key, ABANDONED_RESPONSE.status, body)
    if stored is None:
        return None
    return Outcome(ABANDONED_RESPONSE.status, as_answered(stored), {}, replayed=False)


async def _wait_for(
    tx: AsyncTransaction, claim: _Claim, schedule: dict[str, Any], bound: bool
) -> None:
    """Make ``claim`` again and roll it back (see :meth:`AsyncEngine._settle`)."""
    # Rolled back: no generation is stored.
    await store_async.claim(tx, claim.request, claim.token, 0, schedule, bound=bound)
    raise _Settled  # rolled back: nothing is written


class _Settled(Exception):
    """Rolls back the transaction that waited for an interrupted claim's outcome."""


class _AsyncRun:
    """One attempt at one key record: runs phases and commits their results, fenced."""

    def __init__(
        self,
        engine: AsyncEngine,
        operation: Operation[Any],
        record: KeyRecord,
        token: uuid.UUID,
        observed: RunObservation = NO_RUN,
    ) -> None:
        self.engine = engine
        self.observed = observed
        observed.claimed(record.id, record.recovery_point, record.attempts, record.inserted)
        self.operation = operation
        self.record = record
        wake = waits.wake(record.scope, operation.name, record.idempotency_key)
        self.key = KeyRef(record.id, record.scope, token, record.ctid, *wake)
        self.identity = KeyIdentity(
            operation.name, record.id, record.created_at, record.seed, record.generation
        )
        self.progress = Progress(record.recovery_point, record.state, record.recovery_point)

    @functools.cached_property
    def params(self) -> Any:
        """The params as phases see them; built on first use, so that stored params the
        operation no longer accepts fail inside the run (lease released, attempt counted)."""
        return self.operation.load_params(self.record.request_params)

    async def next(self, phase: Phase, state_json: str) -> Step:
        """Run ``phase`` from the state stored as ``state_json``; a foreign step takes the
        atomic phase after it along."""
        if phase.atomic:
            with self.observed.phase(phase.point, True):
                return await self.engine._transact(self.fenced, phase, state_json)
        # Outside any transaction, and no pooled connection is held meanwhile.
        if faults.active:
            faults.hit("before_foreign", phase.point)
        state = json.loads(state_json)
        renewals = self.record.window_renewals
        # Renewed while the step (or its reconciliation) runs, so that no other attempt
        # starts it beside this one.
        lease = self.engine._heartbeat.hold(self.key, self.operation.lock_timeout.total_seconds())
        try:
            result: object = NotFound
            if self._past_window(phase):
                result = await self._reconcile(phase, state, lease)
                if result is NotFound:  # the provider forgot the call: call anew, fresh key
                    renewals = await self.engine._transact(self._renew_window, renewals)
            if result is NotFound:
                with self.observed.phase(phase.point, False):
                    context = StepContext(state, self.identity, phase.point, lease, renewals)
                    result = await phase.fn(context, self.params)
        finally:
            await self.engine._heartbeat.drop(lease)
        if faults.active:
            faults.hit("after_foreign", phase.point)
        response, new_state, new_state_json = step_result(
            phase, state, state_json, result, self.record.id
        )

        following = self.operation.phases[self.operation.next_phase(phase.point)]
        if response is not None or not following.atomic:
            return await self.engine._transact(
                self._commit_step, phase, response, new_state, new_state_json
            )
        # The step's result commits in the next atomic phase's transaction: one commit less
        # per step. Should that phase fail, the result is committed on its own before the
        # error propagates, so a retry resumes after the step all the same.
        try:
            with self.observed.phase(following.point, True):
                return await self.engine._transact(self.fenced, following, new_state_json)
        except LockLost:
            raise
        except BaseException:
            try:
                await _pg_async.shielded(
                    self.engine._transact,
                    self._commit_step,
                    phase,
                    response,
                    new_state,
                    new_state_json,
                )
            except Exception as exc:
                # The retry runs the step again, with the same downstream key. An outage
                # is one line per request, not a traceback each.
                if is_outage(exc):
                    logger.warning(
                        "could not record foreign step %r of key %s (the database is away)",
                        phase.point,
                        self.record.id,
                    )
                else:
                    logger.exception(
                        "could not record foreign step %r of key %s", phase.point, self.record.id
                    )
            raise

    def _past_window(self, phase: Phase) -> bool:
        """Whether the foreign step ``phase`` may have been called longer ago than its
        provider's dedupe window, so that calling it again could repeat it. Only the step
        right after the point the run was claimed at can be: once the run commits a point,
        the step after it is well inside its window."""
        window = phase.dedupe_window
        return (
            window is not None
            and self.progress.at == self.record.recovery_point
            and self.record.point_age >= window.total_seconds()
        )

    async def _reconcile(
        self, phase: Phase, state: dict[str, Any], lease: heartbeat.Lease
    ) -> object:
        """Ask the provider, through the step's ``reconcile`` hook, what the step's last call
        did: its result, or :data:`NotFound`. Without a hook, hold the key for an operator
        and raise :class:`NeedsReconciliation`."""
        if phase.reconcile is None:
            reason = (
                f"foreign step {phase.point!r} is past its provider's dedupe window "
                f"({phase.dedupe_window}) and declares no reconcile hook: find out what its "
                f"last call did, then run `recoverypoint keys reconcile {self.record.id} "
                "--found JSON` or `--not-found`"
            )
            if not await store_async.hold(self.engine.async_db, self.key, reason):
                raise LockLost()
            logger.warning("key %s is held for reconciliation: %s", self.record.id, reason)
            raise NeedsReconciliation()
        renewals = self.record.window_renewals
        context = StepContext(state, self.identity, phase.point, lease, renewals)
        with self.observed.phase(phase.point, False):
            return await phase.reconcile(context, self.params)

    async def _renew_window(self, tx: AsyncTransaction, renewals: int) -> int:
        """Commit a renewal of the window of the step after the recovery point."""
        return await store_async.renew_window(
            tx, self.key, self.progress.at, renewals, bound=self.engine.bound
        )

    async def fenced(self, tx: AsyncTransaction, phase: Phase, state_json: str) -> Step:
        """Check the lease and lock the key row, then run the atomic ``phase``: a request
        that lost its lease fails with LockLost before its writes can collide with the new
        owner's, and no takeover can happen while the phase runs. A phase that sends nothing
        leaves its fence to the write that records it (one round trip less), except where
        Citus must bind the transaction to the scope's worker first."""
        if phase.sends_nothing and not self.engine.bound:
            store_async.fence_later(tx, self.key)
        else:
            await store_async.fence(tx, self.key, bound=self.engine.bound)
        return await self.atomic(tx, phase, state_json)

    async def atomic(self, tx: AsyncTransaction, phase: Phase, state_json: str) -> Step:
        """Run ``phase`` in ``tx``, which holds the key row (a phase that sends nothing: whose
        write is to lock it), and commit it with its point."""
        # A fresh copy each time: a phase retried after a serialization failure starts over.
        ctx = AsyncAtomicContext(
            tx, json.loads(state_json), self.identity, phase.point, self.engine.observer
        )
        result = await self._call(tx, phase, ctx)
        if not (result is None or isinstance(result, Response | RecoveryPoint)):
            raise TypeError(
                f"atomic phase {phase.point!r} returned {type(result).__name__}; "
                "return None, a Response or a RecoveryPoint"
            )
        if faults.active:
            faults.hit("before_commit", phase.point)
        try:
            step = await self._commit(tx, phase, result, ctx.state, ctx.staged_jobs)
        except store_async.PhaseEndedTransaction:
            # The point is written only in the transaction the phase began in; phase code
            # that ended it and began another makes the write miss.
            raise phase_guard.ended(phase.point) from None
        except store_async.PhaseLeftWorker as exc:
            raise left_scope(self.operation.name, phase.point) from exc.__cause__
        for job in ctx.staged_jobs:  # committed with the phase's recovery point
            self.engine.observer.job_staged(self.operation.name, job.name)
        return step

    async def _call(self, tx: AsyncTransaction, phase: Phase, ctx: AsyncAtomicContext) -> object:
        """Run ``phase``'s code in ``tx``, which it must leave open; what it returned."""
        if phase.sends_nothing:  # nothing to guard: its transaction may not have begun
            return await phase.fn(ctx, self.params)
        with phase_guard.Guarding(tx, phase.point):
            result = await phase.fn(ctx, self.params)
        await ctx.close()
        phase_guard.check_still_open(tx, phase.point)
        return result

    async def compensate(self, tx: AsyncTransaction, phase: Phase) -> None:
        """Run the operation's compensation ``phase`` in ``tx``, which holds the abandoned
        key's row, and commit it with ``compensated_at``, its state and its jobs."""
        ctx = AsyncAtomicContext(
            tx, json.loads(self.record.state), self.identity, phase.point, self.engine.observer
        )
        ctx.recovery_point = self.record.recovery_point
        result = await self._call(tx, phase, ctx)
        if result is not None:
            raise TypeError(
                f"the compensation of {self.operation.name} returned {type(result).__name__}; "
                "return None: an abandoned key keeps the response it was abandoned with"
            )
        try:
            await store_async.compensated(
                tx,
                self.key,
                ctx.staged_jobs,
                dump_state(phase, ctx.state),
                bound=self.engine.bound,
            )
        except store_async.PhaseEndedTransaction:
            raise phase_guard.ended(phase.point) from None
        except store_async.PhaseLeftWorker as exc:
            raise left_scope(self.operation.name, phase.point) from exc.__cause__
        for job in ctx.staged_jobs:  # committed with compensated_at
            self.engine.observer.job_staged(self.operation.name, job.name)

    async def _commit_step(
        self,
        tx: AsyncTransaction,
        phase: Phase,
        response: Response | None,
        state: dict[str, Any],
        state_json: str,
    ) -> Step:
        """Record what the foreign step ``phase`` reached; it stages no jobs."""
        return await self._commit(tx, phase, response, state, [], state_json)

    async def _commit(
        self,
        tx: AsyncTransaction,
        phase: Phase,
        result: object,
        state: dict[str, Any],
        jobs: list[StagedJob],
        state_json: str | None = None,
    ) -> Step:
        """Record what ``phase`` reached (its point, a jump, or the final response) and
        COMMIT, with the jobs it staged; ``state_json``, if given, is ``state`` dumped."""
        if state_json is None:
            state_json = dump_state(phase, state)
        point = phase.point
        if isinstance(result, RecoveryPoint):
            if result.name not in phase.jumps_to:
                raise DeclarationError(
                    f"phase {phase.point!r} returned RecoveryPoint({result.name!r}); "
                    f"declare it with jumps_to=({result.name!r},)"
                )
            point = result.name
        if not isinstance(result, Response):
            if self.operation.next_phase(point) < len(self.operation.phases):
                stored = await store_async.advance(
                    tx, self.key, jobs, self.progress.at, point, state_json, bound=self.engine.bound
                )
                self.progress.committed = phase.point
                return Advanced(point, stored)
            result = NO_CONTENT
        if not is_http_status(result.status):
            raise TypeError(
                f"the Response of phase {phase.point!r} has the status {result.status!r:.40}; "
                "give an HTTP status, an int from 100 to 599"
            )
        headers = safe_headers(result.headers)
        try:
            body_json = canonical_json(result.body)
        except ValueError as exc:
            raise TypeError(f"the Response of phase {phase.point!r} is {exc}") from exc
        stored_body = await store_async.finish(
            tx,
            self.key,
            jobs,
            state_json=state_json,
            status=int(result.status),
            headers_json=canonical_json(headers),
            body_json=body_json,
            bound=self.engine.bound,
        )
        self.progress.committed = phase.point
        return Outcome(result.status, as_answered(stored_body), headers, replayed=False)
