"""Operations: a named, versioned, ordered list of atomic phases and foreign steps.

An operation is declared once, at import time, and checked when it is registered with an
:class:`~recoverypoint.Engine`; a request never discovers a declaration error.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

from pydantic import BaseModel, TypeAdapter, ValidationError

from .errors import DeclarationError, InvalidParams
from .keys import MAX_JSON_DEPTH, canonical_json, check_depth
from .leases import DEFAULT_LOCK_TIMEOUT, MAX_LOCK_TIMEOUT

P = TypeVar("P")
F = TypeVar("F", bound=Callable[..., Any])

STARTED = "started"
FINISHED = "finished"
COMPENSATED = "compensated"
"""What an operation's compensation is named (in its staged jobs' keys, its errors): no
phase of an operation that declares one may take the name."""

# Retentions are added to timestamps in SQL, as leases are (leases.MAX_LOCK_TIMEOUT).
MAX_RETENTION = timedelta(days=36500)
# A provider's dedupe window: a minute is shorter than any provider keeps keys (and than a
# step's own retries); a year is longer than any does.
MIN_DEDUPE_WINDOW = timedelta(minutes=1)
MAX_DEDUPE_WINDOW = timedelta(days=365)
DEFAULT_RETENTION = timedelta(hours=72)
"""How long a finished key is honoured (replayed) when its operation names no retention of
its own; the reaper's default too."""


@dataclass(frozen=True)
class Request:
    """The request a key was first used with; method, path and params make its fingerprint."""

    method: str = "POST"
    path: str = ""


@dataclass(frozen=True)
class Response:
    """A phase's final answer: the key finishes with it, and every retry replays it."""

    status: int
    body: Any = None
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class RecoveryPoint:
    """Returned by an atomic phase to jump forward to a later declared recovery point."""

    name: str


class Withdrawn(Exception):
    """Raised by the first phase of a request to take the request back: nothing was done,
    so the engine deletes the key instead of counting an attempt, and the client's next
    request with the key starts afresh (Stripe saves no result for a request that failed
    validation). Honoured only while the key is still at ``started``; later it is an
    ordinary failure. :meth:`Engine.run` re-raises it, ``answer`` included.

    The HTTP integrations raise it for an answer the framework gave before the endpoint's
    own code ran: a 401 from an auth dependency, a 422 from request validation.
    """

    def __init__(self, answer: object = None) -> None:
        super().__init__("the request was withdrawn before it did anything")
        self.answer = answer


@dataclass(frozen=True)
class Outcome:
    """What :meth:`Engine.run` returns: the stored response, and whether it was a replay."""

    status: int
    body: Any
    headers: dict[str, str]
    replayed: bool


PROBLEM_TYPE_PREFIX = "tag:recoverypoint,2025:"
"""Problem types are URIs that identify a kind of problem without pretending to be a web
page (RFC 9457 §3.1.1 suggests the tag: scheme for that); the last part names the problem."""


def problem_response(status: int, kind: str, title: str, detail: str) -> Response:
    """An answer stored for a key in ``application/problem+json`` (RFC 9457)."""
    body = {"type": PROBLEM_TYPE_PREFIX + kind, "title": title, "status": status, "detail": detail}
    return Response(status, body, {"content-type": "application/problem+json"})


class _NotFound:
    """The type of :data:`NotFound`, its one instance (compared with ``is``)."""

    def __repr__(self) -> str:
        return "rp.NotFound"


NotFound = _NotFound()
"""What a foreign step's ``reconcile=`` hook returns when the provider has no trace of the
step's first call: the engine then calls the step anew, with a fresh downstream key."""


AtomicResult = Response | RecoveryPoint | None
StepResult = Response | Mapping[str, Any] | None


@dataclass(frozen=True)
class Phase:
    """One declared phase: the recovery point it reaches when its work commits."""

    point: str
    kind: Literal["atomic", "foreign"]
    fn: Callable[..., Any]
    jumps_to: tuple[str, ...] = field(default=())
    dedupe_window: timedelta | None = None
    """A foreign step's: how long its provider remembers a downstream key."""
    reconcile: Callable[..., Any] | None = None
    """A foreign step's: asks its provider what a call made past the window did."""
    sends_nothing: bool = False
    """An atomic phase of the library's own that sends no statement (``@idempotent``'s
    answer): its fence goes with the write that records it, in one round trip."""

    @property
    def atomic(self) -> bool:
        return self.kind == "atomic"


class AsyncRunner(Protocol):
    """What ``@idempotent`` and the HTTP integrations need of an engine for async
    operations: ``rp.AsyncEngine``."""

    def register(self, *operations: Operation[Any]) -> None: ...

    async def run(
        self,
        operation: Operation[Any],
        *,
        key: str,
        params: Any,
        scope: str = ...,
        request: Request | None = ...,
        wait: timedelta | float | None = ...,
    ) -> Outcome: ...


class Operation(Generic[P]):
    """A named, versioned, ordered list of phases.

    Parameters
    ----------
    name:
        Stable name stored with every key; renaming the Python functions never orphans keys.
    params:
        Optional type (a pydantic model, dataclass, TypedDict…) that validates and normalises
        the params. Phases receive an instance of it; without it they receive the JSON dict.
    version:
        Bump it when the phases change; unfinished keys resume with the version that
        started them, so keep the old one registered until they are done.
    lock_timeout:
        How long after the attempt that holds a key dies (its process killed, its host
        gone) a retry or the completer may take the key over. A live attempt keeps it:
        each commit renews its lease, and a foreign step's renews it in the background
        every third of ``lock_timeout`` while it runs, however long that is. Shorter
        means a crashed request resumes sooner; the renewals cost a write each.
    max_attempts:
        Attempts after which a key is abandoned. An attempt counts when it is claimed, so
        one whose process died counts too; the completer abandons a key out of attempts,
        and so does a client's retry that would start one more.
    retention:
        How long a finished key of this operation is honoured: until then a call with it
        replays its response; after it, a call with the key is a new request, whether or
        not the reaper has deleted the key yet (the engine decides when it reads the key).
        ``None``: 72 hours (:data:`DEFAULT_RETENTION`). The reaper deletes keys past their
        operation's retention, else past its ``--retention``. An abandoned key is kept, and
        replays its error, until the reaper deletes it after ``--abandoned-retention``.
    """

    @overload
    def __init__(
        self: Operation[Any],
        name: str,
        *,
        params: None = None,
        version: int = 1,
        lock_timeout: timedelta = ...,
        max_attempts: int = 10,
        retention: timedelta | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        name: str,
        *,
        params: type[P],
        version: int = 1,
        lock_timeout: timedelta = ...,
        max_attempts: int = 10,
        retention: timedelta | None = None,
    ) -> None: ...

    def __init__(
        self,
        name: str,
        *,
        params: type[P] | None = None,
        version: int = 1,
        lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
        max_attempts: int = 10,
        retention: timedelta | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > 200 or not _storable(name):
            raise DeclarationError(
                f"operation name must be 1 to 200 printable characters, got {name!r:.220}"
            )
        if version < 1:
            raise DeclarationError(f"operation {name!r}: version must be >= 1, got {version}")
        if not timedelta(0) < lock_timeout <= MAX_LOCK_TIMEOUT:
            raise DeclarationError(
                f"operation {name!r}: lock_timeout must be positive and at most "
                f"{MAX_LOCK_TIMEOUT.days} days, got {lock_timeout}"
            )
        if max_attempts < 1:
            raise DeclarationError(f"operation {name!r}: max_attempts must be >= 1")
        if retention is not None and not timedelta(0) < retention <= MAX_RETENTION:
            raise DeclarationError(
                f"operation {name!r}: retention must be positive and at most "
                f"{MAX_RETENTION.days} days, got {retention}"
            )
        self.name = name
        self.version = version
        self.lock_timeout = lock_timeout
        self.max_attempts = max_attempts
        self.retention = retention
        self.honoured_for = retention or DEFAULT_RETENTION
        self.phases: list[Phase] = []
        self.compensation_phase: Phase | None = None
        """What undoes the committed phases of an abandoned key (:meth:`compensation`)."""
        self._adapter: TypeAdapter[P] | None = TypeAdapter(params) if params is not None else None
        # Sets dump in hash-seed order, which differs between processes: sorted when present.
        self._has_sets = self._adapter is not None and _has_sets(self._adapter.core_schema)

    def __repr__(self) -> str:
        points = " → ".join(p.point for p in self.phases)
        return f"<Operation {self.name} v{self.version}: {STARTED} → {points}>"

    # -- declaration ---------------------------------------------------------------------

    def atomic_phase(self, point: str, *, jumps_to: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Declare the next phase: ``fn(tx: AtomicContext, params)`` in one SERIALIZABLE
        transaction, committing ``point``. List in ``jumps_to`` every later point the
        phase may return as :class:`RecoveryPoint`."""
        return self._declare(point, "atomic", tuple(jumps_to))

    def foreign_step(
        self,
        point: str,
        *,
        dedupe_window: timedelta | None = None,
        reconcile: Callable[..., Any] | None = None,
    ) -> Callable[[F], F]:
        """Declare the next phase: ``fn(step: StepContext, params)`` outside any transaction;
        what it returns is committed with ``point``.

        ``dedupe_window``: how long the step's provider remembers an idempotency key
        (Stripe: 24 hours). Once that long has passed since the step was first called, the
        engine never calls it blindly again: it calls ``reconcile(step: StepContext,
        params)`` instead, with the downstream key the first call used, which asks the
        provider what that call did and returns the step's result (found) or
        :data:`NotFound` (the step is then called anew, with a fresh downstream key).
        Without ``reconcile`` the key waits for an operator (``recoverypoint keys
        reconcile``) and the request raises :class:`~recoverypoint.NeedsReconciliation`.

        The step has run once it returns, so its effect may have happened: a result that
        cannot be stored (not a dict, ``None`` or a :class:`Response`; not JSON; text with
        NUL...) does not make it run again. The key finishes with a 500
        ``application/problem+json`` answer saying the work was done but its result not
        recorded, every retry gets it, and the error is logged for the operator."""
        if dedupe_window is not None and not (
            isinstance(dedupe_window, timedelta)
            and MIN_DEDUPE_WINDOW <= dedupe_window <= MAX_DEDUPE_WINDOW
        ):
            raise DeclarationError(
                f"{self.name}: the dedupe_window of foreign step {point!r} must be between "
                f"{MIN_DEDUPE_WINDOW} and {MAX_DEDUPE_WINDOW.days} days (how long its provider "
                f"remembers an idempotency key), got {dedupe_window}"
            )
        if reconcile is not None and (dedupe_window is None or not callable(reconcile)):
            raise DeclarationError(
                f"{self.name}: foreign step {point!r} declares reconcile= "
                + (
                    "without a dedupe_window: it is called only once the window has passed"
                    if dedupe_window is None
                    else f"as {type(reconcile).__name__}: pass a function (step, params)"
                )
            )
        return self._declare(point, "foreign", (), dedupe_window, reconcile)

    def compensation(self, fn: F) -> F:
        """Declare what undoes the committed phases of a key once it is abandoned (by the
        completer after ``max_attempts``, or by an operator): ``fn(tx: AtomicContext,
        params)``, ``async def`` for :class:`~recoverypoint.AsyncEngine`, as the phases are.

        The completer runs it once per abandoned key, in one SERIALIZABLE transaction
        that holds the key's lease, records ``compensated_at`` and commits the jobs it
        stages. ``tx.state`` is the key's state and ``tx.recovery_point`` the last point
        it committed, so the compensation knows which phases' effects to undo; the key's
        stored response never changes. A compensation that raises commits nothing and is
        tried again on a later pass, with back-off. Without one, an abandoned key's
        committed effects stay, for a human to undo."""
        if self.compensation_phase is not None:
            raise DeclarationError(f"{self.name}: the compensation is declared twice")
        if not callable(fn):
            raise DeclarationError(f"{self.name}: a compensation is a function, got {fn!r:.80}")
        self.compensation_phase = Phase(COMPENSATED, "atomic", fn)
        return fn

    def _declare(
        self,
        point: str,
        kind: Literal["atomic", "foreign"],
        jumps_to: tuple[str, ...],
        dedupe_window: timedelta | None = None,
        reconcile: Callable[..., Any] | None = None,
        *,
        sends_nothing: bool = False,
    ) -> Callable[[F], F]:
        if not isinstance(point, str) or not point or len(point) > 100 or not _storable(point):
            raise DeclarationError(
                f"{self.name}: a recovery point is 1 to 100 printable characters, "
                f"got {point!r:.120}"
            )
        if point == STARTED:
            raise DeclarationError(f"{self.name}: {STARTED!r} is where every request begins")
        if any(p.point == point for p in self.phases):
            raise DeclarationError(f"{self.name}: recovery point {point!r} is declared twice")
        if self.phases and self.phases[-1].point == FINISHED:
            raise DeclarationError(f"{self.name}: no phase may follow {FINISHED!r}")

        def register(fn: F) -> F:
            self.phases.append(
                Phase(point, kind, fn, jumps_to, dedupe_window, reconcile, sends_nothing)
            )
            return fn

        return register

    def validate(self) -> None:
        """Check the whole declaration; :meth:`Engine.register` calls this."""
        if not self.phases:
            raise DeclarationError(f"{self.name}: declare at least one phase")
        if not self.phases[-1].atomic:
            raise DeclarationError(
                f"{self.name}: the last phase {self.phases[-1].point!r} is a foreign step; "
                "end with an atomic phase that records its result and returns a Response"
            )
        if self.compensation_phase is not None and any(p.point == COMPENSATED for p in self.phases):
            raise DeclarationError(
                f"{self.name}: {COMPENSATED!r} names the compensation; name the phase otherwise"
            )
        for index, phase in enumerate(self.phases):
            later = {p.point for p in self.phases[index + 1 :]}
            for target in phase.jumps_to:
                if target not in later:
                    raise DeclarationError(
                        f"{self.name}: phase {phase.point!r} may jump to {target!r}, "
                        "which is not a recovery point declared after it"
                    )

    # -- running -------------------------------------------------------------------------

    def next_phase(self, point: str) -> int:
        """Index of the phase that runs from ``point``."""
        if point == STARTED:
            return 0
        for index, phase in enumerate(self.phases):
            if phase.point == point:
                return index + 1
        raise DeclarationError(
            f"{self.name} v{self.version} declares no recovery point {point!r}; "
            "bump the version when you change the phases and keep the old one registered"
        )

    def dump_params(self, params: Any) -> str:
        """Validate and normalise ``params``; return their canonical JSON, the same in every
        process for the same request. Raises :class:`InvalidParams`."""
        check_depth(params)
        if self._adapter is not None:
            try:
                validated = self._adapter.validate_python(params)
                params = self._adapter.dump_python(validated, mode="json")
            except ValidationError as exc:
                raise InvalidParams(f"the params are not valid for {self.name}: {exc}") from exc
            except RecursionError:
                raise InvalidParams(
                    f"the params nest deeper than {MAX_JSON_DEPTH} levels; flatten the request"
                ) from None
            check_depth(params)
        try:
            if self._has_sets:
                params = _sort_sets(validated, params)
            return canonical_json(params)
        except ValueError as exc:
            raise InvalidParams(f"the params cannot be stored: they are {exc}") from exc

    def load_params(self, params_json: str) -> P:
        """The params as phases see them, rebuilt from what was stored."""
        if self._adapter is not None:
            return self._adapter.validate_json(params_json)
        value: P = json.loads(params_json)
        return value


def _storable(text: str) -> bool:
    """Whether a declared name can be stored and printed: no NUL or other control
    character (PostgreSQL refuses NUL, and controls garble log lines), no lone surrogate."""
    return not any(unicodedata.category(c) in ("Cc", "Cs") for c in text)


def _has_sets(schema: Any) -> bool:
    """Whether a pydantic core schema holds a ``set`` or ``frozenset`` anywhere."""
    pending, seen = [schema], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            if node.get("type") in ("set", "frozenset"):
                return True
            pending.extend(node.values())
        elif isinstance(node, list | tuple):
            pending.extend(node)
    return False


def _sort_sets(value: Any, dumped: Any) -> Any:
    """``dumped`` (the JSON-mode dump of ``value``) with every list that a set became
    sorted by its elements' canonical JSON. Walks ``value`` beside ``dumped``: a set is
    dumped in its own iteration order, so their elements pair up."""
    if isinstance(value, set | frozenset) and isinstance(dumped, list):
        return sorted(
            (_sort_sets(v, d) for v, d in zip(value, dumped, strict=False)), key=canonical_json
        )
    if isinstance(dumped, dict):
        if isinstance(value, Mapping):
            pairs = zip(value.values(), dumped.items(), strict=False)
            return {name: _sort_sets(v, d) for v, (name, d) in pairs}
        if isinstance(value, BaseModel) or dataclasses.is_dataclass(value):
            return {name: _sort_sets(getattr(value, name, None), d) for name, d in dumped.items()}
    if isinstance(value, list | tuple) and isinstance(dumped, list):
        return [_sort_sets(v, d) for v, d in zip(value, dumped, strict=False)]
    return dumped
