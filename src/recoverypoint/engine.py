"""The engine: claim a key, run its phases from the recovery point, replay what finished."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL

from . import _pg, phase_guard, store
from ._pg import Transaction
from .backoff import backoff_delay
from .context import AtomicContext, KeyIdentity, StagedJob, StepContext
from .database import create_engine
from .errors import (
    DeclarationError,
    InvalidParams,
    KeyInUse,
    LockLost,
    OperationNotRegistered,
    ParamsMismatch,
)
from .jobs import JobBackend
from .keys import (
    DEFAULT_MAX_PARAMS_BYTES,
    canonical_json,
    check_size,
    fingerprint,
    safe_headers,
    validate_key,
    validate_request,
    validate_scope,
)
from .observe import CLIENT, COMPLETER, NO_OBSERVER, NO_RUN, Observer, RunObservation
from .operation import (
    STARTED,
    Operation,
    Outcome,
    Phase,
    RecoveryPoint,
    Request,
    Response,
    Withdrawn,
)
from .store import ClaimRequest, KeyRecord
from .testing import faults

logger = logging.getLogger("recoverypoint")

T = TypeVar("T")

# A request that reaches the end of its phases without a Response finishes with this.
_NO_CONTENT = Response(204)


@dataclass(frozen=True)
class _Advanced:
    point: str
    state: str
    """As stored, JSON text: each phase parses its own copy."""


_Step = _Advanced | Outcome


class Engine:
    """Runs registered operations against PostgreSQL.

    Parameters
    ----------
    database:
        A URL (``postgresql://``, ``postgres://`` or ``postgresql+psycopg://``; always run
        on psycopg 3) or an existing :class:`sqlalchemy.Engine` on psycopg 3.
    max_params_bytes:
        Largest canonical params accepted; larger ones raise :class:`RequestTooLarge`.
    serialization_retries:
        In-process retries of a transaction that hit a serialization failure or deadlock
        before :class:`ConcurrentUpdate` (409) is raised.
    retry_base, retry_cap:
        Seconds: the backoff after a failed attempt before the completer may retry the
        key grows from ``retry_base`` to ``retry_cap``.
    jobs:
        Where the enqueuer publishes staged jobs, e.g. :class:`~recoverypoint.jobs.InProcessBackend`
        or :class:`~recoverypoint.integrations.celery.CeleryBackend`; also settable later
        as ``engine.jobs``. The workers find everything they need on the engine.
    observer:
        Hears of every run, phase, retry and staged job, and of the workers' work (see
        :mod:`recoverypoint.observe`): the Prometheus and OpenTelemetry integrations, or
        your own; several at once with :func:`recoverypoint.observe.combine`.
    """

    def __init__(
        self,
        database: str | URL | sa.Engine,
        *,
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
        serialization_retries: int = 10,
        retry_base: float = 2.0,
        retry_cap: float = 3600.0,
        jobs: JobBackend | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.db = create_engine(database)
        if self.db.dialect.driver != "psycopg":
            raise ValueError(
                f"recoverypoint runs on psycopg 3, and this engine uses {self.db.dialect.driver}: "
                "create it from a postgresql+psycopg:// URL"
            )
        self._owns_db = not isinstance(database, sa.Engine)
        phase_guard.install(self.db)
        self.max_params_bytes = max_params_bytes
        self.serialization_retries = serialization_retries
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.jobs = jobs
        self.observer = NO_OBSERVER if observer is None else observer
        self._operations: dict[tuple[str, int], Operation[Any]] = {}

    def register(self, *operations: Operation[Any]) -> None:
        """Make operations runnable; checks each declaration and raises
        :class:`DeclarationError` on the first mistake."""
        for operation in operations:
            operation.validate()
            ident = (operation.name, operation.version)
            known = self._operations.get(ident)
            if known is not None and known is not operation:
                raise DeclarationError(
                    f"another operation is already registered as {ident[0]!r} v{ident[1]}"
                )
            self._operations[ident] = operation

    def operation(self, name: str, version: int) -> Operation[Any]:
        """The registered operation ``name`` at ``version``."""
        try:
            return self._operations[(name, version)]
        except KeyError:
            raise OperationNotRegistered(
                f"operation {name!r} v{version} is not registered with this engine; "
                "call engine.register() with it (keep old versions registered until "
                "their keys have finished)"
            ) from None

    @property
    def operations(self) -> tuple[Operation[Any], ...]:
        """Every registered operation, each version on its own (the completer claims only
        keys it can resume)."""
        return tuple(self._operations.values())

    def dispose(self) -> None:
        """Close the pooled connections of the engine made from a URL; an engine you passed
        in is yours to dispose."""
        if self._owns_db:
            self.db.dispose()

    # -- the request path ----------------------------------------------------------------

    def run(
        self,
        operation: Operation[Any],
        *,
        key: str,
        params: Any,
        scope: str = "",
        request: Request | None = None,
    ) -> Outcome:
        """Run ``operation`` once per ``(scope, operation, key)``.

        A new key runs every phase; an unfinished key resumes after its recovery point; a
        finished key replays its stored response (``Outcome.replayed``). Raises an
        :class:`IdempotencyError` for bad input (nothing stored), a key in use or reused
        with other params, and re-raises what a phase raised once the lease is released.
        """
        observing = self.observer.run(
            operation.name, operation.version, by=CLIENT, scope=scope, key=key
        )
        with observing as observed:
            return observed.finished(self._run(observed, operation, key, params, scope, request))

    def _run(
        self,
        observed: RunObservation,
        operation: Operation[Any],
        key: str,
        params: Any,
        scope: str,
        request: Request | None,
    ) -> Outcome:
        if self._operations.get((operation.name, operation.version)) is not operation:
            self.operation(operation.name, operation.version)  # raises: not registered
            raise OperationNotRegistered(
                f"another operation is registered as {operation.name!r} v{operation.version}"
            )
        request = request or Request()
        key = validate_key(key)
        scope = validate_scope(scope)
        method, path = validate_request(request.method, request.path)
        params_json = operation.dump_params(params)
        check_size(params_json, self.max_params_bytes)
        claim_request = ClaimRequest(
            scope=scope,
            operation=operation.name,
            key=key,
            version=operation.version,
            method=method,
            path=path,
            params_json=params_json,
            fingerprint=fingerprint(method, path, params_json),
            token=uuid.uuid4(),
        )
        first = self._transact(
            lambda tx: self._claim(tx, operation, claim_request, params, observed)
        )
        if isinstance(first, Outcome):
            return first
        run, step = first
        return self._drive(run, step)

    def resume(self, key_id: int, *, token: uuid.UUID | None = None) -> Outcome:
        """Resume the unfinished key record ``key_id`` from its recovery point, in-process,
        with the operation registered under its stored name and version; the completer
        does this for every key it claims.

        A finished key returns its stored response (``replayed=True``). Raises
        :class:`OperationNotRegistered` before touching the key, :class:`KeyInUse` when
        another request holds its lease, :class:`LookupError` when there is no such key,
        and what a phase raised, once the lease is released and the attempt counted.
        ``token`` is a lease the caller already holds on the key; without it the lease is
        taken if it is free or expired.
        """
        ident = store.key_operation(self.db, key_id)
        if ident is None:
            raise LookupError(f"there is no key record {key_id}")
        operation = self.operation(*ident)
        token = token or uuid.uuid4()
        lock_timeout = operation.lock_timeout.total_seconds()  # of the key's own version
        observing = self.observer.run(
            operation.name, operation.version, by=COMPLETER, scope=None, key=None
        )
        with observing as observed:
            record = self._transact(lambda tx: store.claim_by_id(tx, key_id, token, lock_timeout))
            if record is None:
                raise LookupError(f"key record {key_id} was deleted")
            if record.claimed:
                run = _Run(self, operation, record, token, observed)
                return observed.finished(self._drive(run, None))
            if record.response_status is not None:
                return observed.finished(_replay(record))
            lease_left = record.lease_left(lock_timeout)
            raise KeyInUse(f"key record {key_id} is in use", retry_after=max(1, lease_left))

    def _claim(
        self,
        tx: Transaction,
        operation: Operation[Any],
        request: ClaimRequest,
        params: Any,
        observed: RunObservation,
    ) -> Outcome | tuple[_Run, _Step | None]:
        """The claim's transaction; a new key runs its first atomic phase in it too, so a
        new request costs one commit less and leaves nothing behind if that phase fails.
        A finished key is looked up first, alone: a replay costs one round trip."""
        record = store.finished_key(tx, request) or store.claim(tx, request)
        if record is None:
            # The row was deleted between the conflict and the read: a reaper raced us.
            raise KeyInUse(key=request.key, retry_after=1)
        if not record.inserted:
            # A key is judged by the version that started it: its params rules, its lease.
            operation = self._started_by(operation, record)
            if _fingerprint_as(operation, request, params) != record.fingerprint:
                raise ParamsMismatch(key=request.key)
            if record.response_status is not None:
                return _replay(record)
            lock_timeout = operation.lock_timeout.total_seconds()
            lease_left = record.lease_left(lock_timeout)
            if lease_left > 0:
                raise KeyInUse(key=request.key, retry_after=lease_left)
            # An unfinished key whose lease is free or expired: take it over.
            record = store.claim_by_id(tx, record.id, request.token, lock_timeout)
            if record is None or not record.claimed:
                lease_left = 1 if record is None else max(1, record.lease_left(lock_timeout))
                raise KeyInUse(key=request.key, retry_after=lease_left)
        run = _Run(self, operation, record, request.token, observed)
        if record.inserted and operation.phases[0].atomic:
            store.held(tx, run.key, record)
            with observed.phase(operation.phases[0].point, True):
                return run, run.atomic(tx, operation.phases[0], "{}")
        return run, None

    def _started_by(self, operation: Operation[Any], record: KeyRecord) -> Operation[Any]:
        """The registered version of ``operation`` that started the key of ``record``. A
        finished key replays without it, so one whose version is gone is judged by the
        caller's."""
        if record.operation_version == operation.version:
            return operation
        if record.response_status is not None:
            return self._operations.get((operation.name, record.operation_version), operation)
        return self.operation(operation.name, record.operation_version)

    def _drive(self, run: _Run, step: _Step | None) -> Outcome:
        state = run.record.state
        try:
            while True:
                if step is not None and faults.active:
                    faults.hit("after_commit", run.committed)
                if isinstance(step, Outcome):
                    return step
                if step is not None:
                    run.at, state = step.point, step.state
                phase = run.operation.phases[run.operation.next_phase(run.at)]
                step = run.next(phase, state)
        except LockLost:
            raise
        except Withdrawn as exc:
            if not (run.committed == STARTED and self._withdraw(run)):
                self._release(run, exc)
            raise
        except BaseException as exc:
            self._release(run, exc)
            raise

    def _withdraw(self, run: _Run) -> bool:
        """Delete the key of a run withdrawn before it recorded anything."""
        try:
            return store.withdraw(self.db, run.key)
        except Exception:
            logger.exception("could not withdraw key %s", run.record.id)
            return False

    def _release(self, run: _Run, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        retry_in = backoff_delay(run.record.attempts, base=self.retry_base, cap=self.retry_cap)
        try:
            released = store.release(self.db, run.key, error, retry_in)
        except Exception:
            # The lease then simply expires; the original error matters more.
            logger.exception("could not release key %s after: %s", run.record.id, error)
            return
        logger.warning(
            "key %s of %s failed at %s (lease %s): %s",
            run.record.id,
            run.operation.name,
            run.at,
            "released" if released else "already taken over",
            error,
        )

    def _transact(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in one SERIALIZABLE transaction (see :mod:`recoverypoint._pg`)."""
        return _pg.serializable(self.db, work, self.serialization_retries, self.observer)


class _Run:
    """One attempt at one key record: runs phases and commits their results, fenced."""

    def __init__(
        self,
        engine: Engine,
        operation: Operation[Any],
        record: KeyRecord,
        token: uuid.UUID,
        observed: RunObservation = NO_RUN,
    ) -> None:
        self.engine = engine
        self.observed = observed
        observed.claimed(record.id, record.recovery_point, record.attempts + 1, record.inserted)
        self.operation = operation
        self.record = record
        self.key = store.KeyRef(record.id, token, record.ctid)
        self.identity = KeyIdentity(operation.name, record.id, record.created_at)
        self.at = record.recovery_point  # the point the key row holds, as far as we know
        self.committed = record.recovery_point  # the last point this run committed

    @functools.cached_property
    def params(self) -> Any:
        """The params as phases see them; built on first use, so that stored params the
        operation no longer accepts fail inside the run (lease released, attempt counted)."""
        return self.operation.load_params(self.record.request_params)

    def next(self, phase: Phase, state_json: str) -> _Step:
        """Run ``phase`` from the state stored as ``state_json``; a foreign step takes the
        atomic phase after it along."""
        if phase.atomic:
            with self.observed.phase(phase.point, True):
                return self.engine._transact(lambda tx: self.fenced(tx, phase, state_json))
        # Outside any transaction, and no pooled connection is held meanwhile.
        if faults.active:
            faults.hit("before_foreign", phase.point)
        state = json.loads(state_json)
        with self.observed.phase(phase.point, False):
            result = phase.fn(StepContext(state, self.identity, phase.point), self.params)
        if faults.active:
            faults.hit("after_foreign", phase.point)
        if isinstance(result, Response):
            new_state = state
        elif result is None or isinstance(result, Mapping):
            new_state = {**state, **(result or {})}
        else:
            raise TypeError(
                f"foreign step {phase.point!r} returned {type(result).__name__}; "
                "return a dict, None or a Response"
            )

        def commit_step(tx: Transaction) -> _Step:
            return self._commit(tx, phase, result, new_state, [])

        following = self.operation.phases[self.operation.next_phase(phase.point)]
        if isinstance(result, Response) or not following.atomic:
            return self.engine._transact(commit_step)
        new_state_json = _state_json(phase, new_state)
        # The step's result commits in the next atomic phase's transaction: one commit less
        # per step. Should that phase fail, the result is committed on its own before the
        # error propagates, so a retry resumes after the step all the same.
        try:
            with self.observed.phase(following.point, True):
                return self.engine._transact(lambda tx: self.fenced(tx, following, new_state_json))
        except LockLost:
            raise
        except BaseException:
            try:
                self.engine._transact(commit_step)
            except Exception:
                logger.exception(
                    "could not record foreign step %r of key %s", phase.point, self.record.id
                )
            raise

    def fenced(self, tx: Transaction, phase: Phase, state_json: str) -> _Step:
        """Check the lease and lock the key row, then run the atomic ``phase``: a request
        that lost its lease fails with LockLost before its writes can collide with the new
        owner's, and no takeover can happen while the phase runs."""
        store.fence(tx, self.key)
        return self.atomic(tx, phase, state_json)

    def atomic(self, tx: Transaction, phase: Phase, state_json: str) -> _Step:
        """Run ``phase`` in ``tx``, which holds the key row, and commit it with its point."""
        began = self.key.xid
        # A fresh copy each time: a phase retried after a serialization failure starts over.
        ctx = AtomicContext(
            tx, json.loads(state_json), self.identity, phase.point, self.engine.observer
        )
        with phase_guard.guarding(tx, phase.point):
            result = phase.fn(ctx, self.params)
        ctx.close()
        phase_guard.check_still_open(tx, phase.point)
        if not (result is None or isinstance(result, Response | RecoveryPoint)):
            raise TypeError(
                f"atomic phase {phase.point!r} returned {type(result).__name__}; "
                "return None, a Response or a RecoveryPoint"
            )
        if faults.active:
            faults.hit("before_commit", phase.point)
        try:
            step = self._commit(tx, phase, result, ctx.state, ctx.staged_jobs)
        except LockLost:
            # The point is written only in the transaction the phase began in; phase code
            # that ended it and began another makes the write miss.
            if tx.open:
                phase_guard.check_same_transaction(
                    phase.point, began, store.current_transaction(tx)
                )
            raise
        for job in ctx.staged_jobs:  # committed with the phase's recovery point
            self.engine.observer.job_staged(self.operation.name, job.name)
        return step

    def _commit(
        self,
        tx: Transaction,
        phase: Phase,
        result: object,
        state: dict[str, Any],
        jobs: list[StagedJob],
    ) -> _Step:
        """Record what ``phase`` reached (its point, a jump, or the final response) and
        COMMIT, with the jobs it staged."""
        state_json = _state_json(phase, state)
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
                stored = store.advance(tx, self.key, jobs, self.at, point, state_json)
                self.committed = phase.point
                return _Advanced(point, stored)
            result = _NO_CONTENT
        headers = safe_headers(result.headers)
        try:
            body_json = canonical_json(result.body)
        except ValueError as exc:
            raise TypeError(f"the Response of phase {phase.point!r} is {exc}") from exc
        stored_body = store.finish(
            tx,
            self.key,
            jobs,
            state_json=state_json,
            status=result.status,
            headers_json=canonical_json(headers),
            body_json=body_json,
        )
        self.committed = phase.point
        return Outcome(result.status, _as_answered(stored_body), headers, replayed=False)


def _state_json(phase: Phase, state: dict[str, Any]) -> str:
    try:
        return canonical_json(state)
    except ValueError as exc:
        raise TypeError(f"the state after phase {phase.point!r} is {exc}") from exc


def _replay(record: KeyRecord) -> Outcome:
    """The stored response, exactly as its first answer gave it."""
    assert record.response_status is not None
    body = _as_answered(record.response_body)
    return Outcome(record.response_status, body, dict(record.response_headers or {}), True)


def _as_answered(stored_body: str | None) -> Any:
    """A body as jsonb stored it (its text), with its keys in the order every answer gives
    them (jsonb keeps an order of its own). The first answer is built from the stored body
    as well, so that it equals every replay, types included (jsonb reads 1e16 back as an
    int)."""
    if stored_body is None:
        return None
    return json.loads(stored_body, object_pairs_hook=_sorted_object)


def _sorted_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(sorted(pairs, key=lambda pair: pair[0]))


def _fingerprint_as(operation: Operation[Any], request: ClaimRequest, params: Any) -> str | None:
    """The request's fingerprint by the rules of ``operation``, the version that started the
    key, which may predate the caller's; ``None`` when that version refuses the params.
    The caller's own params come first; its dump second (a model of the caller's version
    is not one of the older version's)."""
    if operation.version == request.version:
        return request.fingerprint
    for candidate in (params, json.loads(request.params_json)):
        try:
            params_json = operation.dump_params(candidate)
        except InvalidParams:
            continue
        return fingerprint(request.method, request.path, params_json)
    return None
