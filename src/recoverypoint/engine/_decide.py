"""The request path's pure part, shared by :class:`~recoverypoint.Engine` and
:class:`~recoverypoint.AsyncEngine`: the registry of operations, the records the claim
reads, and what a claim or a phase's result decides. Nothing here does IO."""

from __future__ import annotations

import inspect
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from operator import itemgetter
from typing import Any, NamedTuple

from .. import leases
from ..errors import (
    DeclarationError,
    InvalidParams,
    LockLost,
    OperationNotRegistered,
    ParamsMismatch,
    PhaseLeftScope,
)
from ..keys import (
    canonical_json,
    check_size,
    fingerprint,
    is_http_status,
    key_seed,
    safe_headers,
    validate_key,
    validate_request,
    validate_scope,
)
from ..operation import (
    STARTED,
    Operation,
    Outcome,
    Phase,
    Request,
    Response,
    problem_response,
)

logger = logging.getLogger("recoverypoint")

# A request that reaches the end of its phases without a Response finishes with this.
NO_CONTENT = Response(204)


class Requested(NamedTuple):
    """The key a request names, checked (:meth:`Registry.requested`): what a finished key's
    lookup reads by, before the params are."""

    scope: str
    operation: str
    key: str
    method: str
    path: str


class ClaimRequest(NamedTuple):
    """A request, validated, as the claim stores it. (The records here are named tuples:
    immutable, and made in a fifth of the time of a frozen dataclass, once per request.)"""

    scope: str
    operation: str
    key: str
    version: int
    method: str
    path: str
    params_json: str
    fingerprint: str
    namespace: str
    """The database's, of derived keys: :attr:`seed` is made from it."""
    lock_timeout: float
    """Seconds: the operation's, stored with the lease the claim takes."""

    @property
    def seed(self) -> str:
        """What every key derived for the request is made from (:func:`.keys.key_seed`):
        made when a claim writes it, which a replay never does."""
        return key_seed(self.namespace, self.scope, self.operation, self.key)


class KeyId(NamedTuple):
    """An unfinished key to take by id, and the rules of the version that started it; named
    as the statements that take it name their parameters."""

    scope: str
    id: int
    token: uuid.UUID
    """The lease to take, or the one the caller already holds (a completer's reservation)."""
    lock_timeout: float
    """Seconds: the version's lock timeout."""
    max_attempts: int
    """The version's: a key that has counted as many attempts gets no more."""


class KeyRecord(NamedTuple):
    """The claim's view of a key record."""

    id: int
    scope: str
    idempotency_key: str
    created_at: datetime
    operation_version: int
    fingerprint: str
    recovery_point: str
    state: str
    """The state as JSON text, and the params and body below likewise."""
    request_params: str
    response_status: int | None
    response_headers: dict[str, str] | None
    response_body: str | None
    attempts: int
    seed: str | None
    """The row's derivation seed; ``None`` for a row claimed before seeds existed."""
    generation: int
    """Which use of the key this is (:mod:`recoverypoint.generations`)."""
    ctid: str
    point_age: float
    """Seconds since the recovery point was committed (the key created, in rows older than
    migration 0013), on the database's clock."""
    window_renewals: int
    """Times the step after the point was called anew past its provider's dedupe window."""
    held: bool
    """Whether the key waits for an operator's reconciliation."""
    claimed: bool
    inserted: bool
    held_for: float | None

    @classmethod
    def parse(cls, row: Sequence[str | None]) -> KeyRecord:
        """The record from the text of its columns
        (:data:`recoverypoint.engine.sql._RECORD_COLUMNS`, then ``claimed``, ``inserted``
        and ``held_for``)."""
        (
            key_id, scope, key, created_at, version, fingerprint, point, state, params,
            status, headers, body, attempts, seed, generation, ctid, point_age, renewals, held,
            claimed, inserted, held_for,
        ) = row  # fmt: skip
        assert key_id and scope is not None and key and created_at and version and fingerprint
        assert point and state
        assert params is not None and attempts and generation and ctid and point_age
        assert renewals
        return cls(
            int(key_id),
            scope,
            key,
            datetime.fromisoformat(created_at).replace(tzinfo=timezone.utc),
            int(version),
            fingerprint,
            point,
            state,
            params,
            None if status is None else int(status),
            None if headers is None else json.loads(headers),
            body,
            int(attempts),
            seed,
            int(generation),
            ctid,
            float(point_age),
            int(renewals),
            held == "true",
            claimed == "t",
            inserted == "t",
            None if held_for is None else float(held_for),
        )

    @classmethod
    def new_row(cls, row: Sequence[str | None], request: ClaimRequest, seed: str) -> KeyRecord:
        """The record the claim inserted, from what it wrote and the columns it returned
        (:data:`recoverypoint.engine.sql.CLAIM`: id, creation time in seconds since the
        epoch, address, the params as jsonb stored them, which every later run of the key
        reads too, and the generation)."""
        key_id, created_at, ctid, params, generation = row[:5]  # then the token's, if set
        assert key_id and created_at and ctid and params is not None and generation
        return cls(
            int(key_id),
            request.scope,
            request.key,
            _from_epoch(created_at),
            request.version,
            request.fingerprint,
            STARTED,
            "{}",
            params,
            None,
            None,
            None,
            1,
            seed,
            int(generation),
            ctid,
            0.0,  # its point was reached as it was inserted
            0,
            held=False,
            claimed=True,
            inserted=True,
            held_for=None,
        )

    def lease_left(self, lock_timeout: float) -> int:
        """Whole seconds until the lease expires under ``lock_timeout``; 0 when free."""
        return leases.left(self.held_for, lock_timeout)

    def exhausted(self, max_attempts: int) -> bool:
        """Whether the unfinished key has counted ``max_attempts`` attempts: the next one
        it would start abandons it instead. Never one held for an operator's
        reconciliation, whose decision that is."""
        return self.response_status is None and not self.held and self.attempts >= max_attempts


class Finished(NamedTuple):
    """A finished key as a replay reads it: the version that started it and the request's
    fingerprint, which judge a reused key, and the stored response."""

    operation_version: int
    fingerprint: str
    response_status: int
    response_headers: dict[str, str] | None
    response_body: str | None
    """As JSON text: :func:`replay` parses it."""
    expired: bool
    """Past the retention it is honoured for: a reuse of the key is a new request."""

    @classmethod
    def parse(cls, row: Sequence[str | None]) -> Finished:
        """The record from the text of the columns of
        :data:`recoverypoint.engine.sql.FIND_FINISHED`."""
        version, fingerprint, status, headers, body, expired = row
        assert version and fingerprint and status
        return cls(
            int(version),
            fingerprint,
            int(status),
            _headers(headers),
            body,
            expired == "t",  # a boolean's text
        )


def _headers(stored: str | None) -> dict[str, str] | None:
    # Most responses carry no headers of their own: their '{}' is not parsed.
    if stored is None:
        return None
    return {} if stored == "{}" else json.loads(stored)


@dataclass
class KeyRef:
    """Where a claimed key is, and the lease it is held under."""

    id: int
    scope: str
    token: uuid.UUID
    ctid: str
    wake_lock: int
    wake_channel: str
    """The key's advisory lock and NOTIFY channel (:func:`recoverypoint.engine.waits.wake`),
    for the writes that wake its waiters."""
    locked_by: object = None
    """The transaction whose fence or claim locked the row at ``ctid``, if still open, or
    whose write that records its phase is to lock it (:attr:`fence_left_to`)."""
    fence_left_to: object = None
    """The transaction whose phase sends nothing and leaves its fence to the write that
    records it (:func:`recoverypoint.engine.store.fence_later`), until that write is sent."""


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _from_epoch(text: str) -> datetime:
    """The instant PostgreSQL gave as seconds since the epoch, to the microsecond: read as
    its digits (a float would round some), so that it equals the same row's creation time
    read back as text (:data:`recoverypoint.engine.sql._RECORD_COLUMNS`)."""
    seconds, _, fraction = text.partition(".")
    return _EPOCH + timedelta(seconds=int(seconds), microseconds=int(fraction.ljust(6, "0")))


def written(key: KeyRef, row: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """Record the row's new address, or raise :class:`LockLost`."""
    if row is None or row[0] is None:
        raise LockLost()
    key.ctid = row[0]
    return row


@dataclass(frozen=True)
class Advanced:
    """A phase committed a recovery point that is not the last."""

    point: str
    state: str
    """As stored, JSON text: each phase parses its own copy."""


Step = Advanced | Outcome


@dataclass
class Progress:
    """Where one run stands, kept in this one place."""

    at: str
    """The recovery point the key row holds, as far as the run knows."""
    state: str
    """The state stored with it, as JSON text."""
    committed: str
    """The last point the run itself committed (where a withdrawal is still allowed)."""

    def reached(self, step: Advanced) -> None:
        self.at, self.state = step.point, step.state


class Registry:
    """The operations an engine runs, each version on its own; ``async def`` phases for
    the async engine, plain ones for the sync engine, so that no phase ever runs on a
    thread it was not written for (and loses its context variables)."""

    def __init__(self, *, asynchronous: bool) -> None:
        self._asynchronous = asynchronous
        self._operations: dict[tuple[str, int], Operation[Any]] = {}

    def register(self, *operations: Operation[Any]) -> None:
        """Make operations runnable; checks each declaration and raises
        :class:`DeclarationError` on the first mistake."""
        for operation in operations:
            operation.validate()
            compensation = operation.compensation_phase
            for phase in [*operation.phases, *([compensation] if compensation else [])]:
                self._check_kind(operation, phase)
            ident = (operation.name, operation.version)
            known = self._operations.get(ident)
            if known is not None and known is not operation:
                raise DeclarationError(
                    f"another operation is already registered as {ident[0]!r} v{ident[1]}"
                )
            self._operations[ident] = operation

    def _check_kind(self, operation: Operation[Any], phase: Phase) -> None:
        if phase.reconcile is not None and (
            inspect.iscoroutinefunction(phase.reconcile) != self._asynchronous
        ):
            kind = "async def" if self._asynchronous else "a plain def"
            raise DeclarationError(
                f"{operation.name}: the reconcile hook of {phase.point!r} must be {kind}, "
                f"as its step is for {type(self).__name__}"
            )
        if inspect.iscoroutinefunction(phase.fn) == self._asynchronous:
            return
        if self._asynchronous:
            raise DeclarationError(
                f"{operation.name}: phase {phase.point!r} is a plain function and "
                "rp.AsyncEngine runs async def phases only; declare it with async def, "
                "or register the operation with rp.Engine"
            )
        raise DeclarationError(
            f"{operation.name}: phase {phase.point!r} is async def; run the operation "
            "on rp.AsyncEngine, or declare every phase with a plain def for rp.Engine"
        )

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

    def check_registered(self, operation: Operation[Any]) -> None:
        """Raise :class:`OperationNotRegistered` unless ``operation`` itself is registered."""
        if self._operations.get((operation.name, operation.version)) is not operation:
            self.operation(operation.name, operation.version)  # raises: not registered
            raise OperationNotRegistered(
                f"another operation is registered as {operation.name!r} v{operation.version}"
            )

    @property
    def operations(self) -> tuple[Operation[Any], ...]:
        """Every registered operation, each version on its own (the completer claims only
        keys it can resume)."""
        return tuple(self._operations.values())

    def requested(
        self, operation: Operation[Any], key: str, scope: str, request: Request | None
    ) -> Requested:
        """The key ``operation`` is run under, checked: what its lookup names; raises
        before anything is sent."""
        self.check_registered(operation)
        key = validate_key(key)
        scope = validate_scope(scope)
        request = request or Request()
        method, path = validate_request(request.method, request.path)
        return Requested(scope, operation.name, key, method, path)

    def judge(
        self,
        operation: Operation[Any],
        request: ClaimRequest,
        params: Any,
        record: KeyRecord | Finished,
    ) -> Operation[Any]:
        """The version of ``operation`` that started the key of ``record``, whose rules judge
        a reused key; raises :class:`ParamsMismatch` when the key was first used with
        another method, path or params."""
        started = self.started_by(operation, record)
        if fingerprint_as(started, request, params) != record.fingerprint:
            raise ParamsMismatch(key=request.key)
        return started

    def started_by(self, operation: Operation[Any], record: KeyRecord | Finished) -> Operation[Any]:
        """The registered version of ``operation`` that started the key of ``record``. A
        finished key replays without it, so one whose version is gone is judged by the
        caller's."""
        if record.operation_version == operation.version:
            return operation
        if record.response_status is not None:
            return self._operations.get((operation.name, record.operation_version), operation)
        return self.operation(operation.name, record.operation_version)


def claim_request(
    operation: Operation[Any],
    requested: Requested,
    params: Any,
    max_params_bytes: int,
    namespace: str,
) -> ClaimRequest:
    """The request to claim: ``params`` validated and fingerprinted, the costlier half of a
    request's checks, which the engine makes with the key's lookup (see
    :meth:`Registry.requested` for the other half); raises before anything is stored.
    ``namespace``: the database's, of derived keys."""
    params_json = operation.dump_params(params)
    check_size(params_json, max_params_bytes)
    method, path = requested.method, requested.path
    return ClaimRequest(
        scope=requested.scope,
        operation=requested.operation,
        key=requested.key,
        version=operation.version,
        method=method,
        path=path,
        params_json=params_json,
        fingerprint=fingerprint(method, path, params_json),
        namespace=namespace,
        lock_timeout=operation.lock_timeout.total_seconds(),
    )


ABANDONED_RESPONSE = Response(
    500,
    {
        "error": "request_abandoned",
        "message": "This request failed too many times and will not be retried.",
    },
)
"""What an abandoned key answers, and replays to a client that retries it: the completer
finishes a key with it once the key is out of attempts, and so does a client's retry that
would start one attempt more."""


# What a key answers once a foreign step ran but its result could not be stored: the work
# is done and must not be done again, and nothing a client can change would help.
STEP_NOT_RECORDED = problem_response(
    500,
    "step-result-not-recorded",
    "The work was done but its result could not be recorded",
    "The work this request asked for was done, but its result could not be recorded, so it "
    "is not done again for this Idempotency-Key. The service's operators have been told; "
    "ask them before you send the request again with another key.",
)


def step_result(
    phase: Phase, state: dict[str, Any], state_json: str, result: object, key_id: int
) -> tuple[Response | None, dict[str, Any], str]:
    """What a foreign step that returned ``result`` from ``state`` (stored as
    ``state_json``) commits: its Response, if it returned one, and the state after it, with
    its JSON (made here to check it, and kept for the phase after the step). A result that
    cannot be stored makes the key finish with :data:`STEP_NOT_RECORDED` (the step ran:
    running it again could repeat its effect)."""
    try:
        if isinstance(result, Response):
            if not is_http_status(result.status):
                raise TypeError(f"its status {result.status!r:.40} is not an HTTP status")
            canonical_json(result.body)
            canonical_json(safe_headers(result.headers))
            return result, state, state_json
        if result is None or isinstance(result, Mapping):
            new_state = {**state, **(result or {})}
            return None, new_state, dump_state(phase, new_state)
        raise TypeError(
            f"foreign step {phase.point!r} returned {type(result).__name__}; "
            "return a dict, None or a Response"
        )
    except Exception as exc:  # whatever the result's own serialisation raises
        logger.error(
            "key %s: foreign step %r ran, but its result cannot be stored (%s); the key "
            "finishes with a 500 answer and the step does not run again",
            key_id,
            phase.point,
            exc,
        )
        return STEP_NOT_RECORDED, state, state_json


def dump_state(phase: Phase, state: dict[str, Any]) -> str:
    try:
        return canonical_json(state)
    except ValueError as exc:
        raise TypeError(f"the state after phase {phase.point!r} is {exc}") from exc


def replay(record: KeyRecord | Finished) -> Outcome:
    """The stored response, exactly as its first answer gave it."""
    assert record.response_status is not None
    body = as_answered(record.response_body)
    return Outcome(record.response_status, body, dict(record.response_headers or {}), True)


def as_answered(stored_body: str | None) -> Any:
    """A body as jsonb stored it (its text), with its keys in the order every answer gives
    them (jsonb keeps an order of its own). The first answer is built from the stored body
    as well, so that it equals every replay, types included (jsonb reads 1e16 back as an
    int)."""
    if stored_body is None:
        return None
    return _ANSWERED.decode(stored_body)


_NAME = itemgetter(0)


def _sorted_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(sorted(pairs, key=_NAME))


# One decoder for every answer: json.loads with a hook builds a new one per call, which
# cost as much as the decoding of a small body.
_ANSWERED = json.JSONDecoder(object_pairs_hook=_sorted_object)


def fingerprint_as(operation: Operation[Any], request: ClaimRequest, params: Any) -> str | None:
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


def left_scope(operation: str, point: str) -> PhaseLeftScope:
    """The error for phase ``point`` of ``operation`` that Citus refused to commit, having
    written outside its scope (see :class:`store.PhaseLeftWorker`)."""
    return PhaseLeftScope(
        f"atomic phase {point!r} of {operation} wrote outside its scope (another scope's "
        "rows, a reference table, every shard of a table): on another Citus worker, Citus "
        "would have committed it by two-phase commit, where SERIALIZABLE does not hold; on "
        "its own, it would fail once a rebalance moved the scopes apart. Refused: nothing "
        "was committed. Name the scope in every statement of the phase; do cross-tenant "
        "work in a foreign step or in another operation"
    )
