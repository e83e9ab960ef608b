"""What the engine, the workers and :func:`~recoverypoint.jobs.consume_once` report, for
metrics, traces or your own stack: one :class:`Observer`, passed as ``Engine(observer=...)``.

Every method of :class:`Observer` does nothing, so a subclass overrides only the events it
wants, and an engine without an observer pays one empty call per event: the request path
builds no dict, string or object for an observer that does not listen. Events carry plain
values (names, counts, seconds), never a key or a scope, except :meth:`Observer.run`,
which hands both over for observers that record them when their user opts in.

Two kinds of hooks:

- events, plain calls (:meth:`Observer.job_staged`, :meth:`Observer.serialization_retry`…);
- scopes, context managers around the work (:meth:`Observer.run` and the
  :class:`RunObservation`'s :meth:`~RunObservation.phase`, :meth:`Observer.publishing`,
  :meth:`Observer.consuming`), entered in the thread that does the work, so that a tracing
  observer can make its span current and the application's own spans nest under it.
  Events raised inside a scope (a retry inside a phase) happen while it is entered.

``recoverypoint.integrations.prometheus`` and ``recoverypoint.integrations.otel`` are
observers; :func:`combine` runs several side by side.

An observer never changes an outcome: the engine, the workers and ``consume_once`` call it
through :func:`isolated`, so a hook that raises (a metrics push or a trace exporter down)
is logged, once per observer, hook and kind of error, and the work goes on as if it had
not been observed. A scope cannot swallow the work's error either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import (
    InvalidKey,
    InvalidParams,
    KeyInUse,
    LockLost,
    ParamsMismatch,
    RequestTooLarge,
)
from .operation import Outcome, Withdrawn

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger("recoverypoint")

T = TypeVar("T")

OUTCOMES = (
    "new",
    "resumed",
    "replayed",
    "in_use",
    "mismatch",
    "invalid",
    "withdrawn",
    "lock_lost",
    "failed",
)
"""How a run ends: ``new`` and ``resumed`` ran phases up to a stored response (a new key,
or one a previous attempt left unfinished); ``replayed`` returned a stored response;
``in_use``, ``mismatch``, ``invalid``, ``withdrawn`` (a first phase took the request back,
see :class:`~recoverypoint.operation.Withdrawn`) and ``lock_lost`` are the refusals;
``failed`` is everything else a run raised."""

CLIENT, COMPLETER = "client", "completer"
"""Who runs a key: :meth:`Engine.run` (a client's request) or :meth:`Engine.resume`."""

_REFUSALS: tuple[tuple[type[BaseException], str], ...] = (
    (KeyInUse, "in_use"),
    (ParamsMismatch, "mismatch"),
    (InvalidKey, "invalid"),
    (InvalidParams, "invalid"),
    (RequestTooLarge, "invalid"),
    (Withdrawn, "withdrawn"),
    (LockLost, "lock_lost"),
)


def outcome_of(error: BaseException) -> str:
    """The outcome of a run that raised ``error``."""
    for kind, outcome in _REFUSALS:
        if isinstance(error, kind):
            return outcome
    return "failed"


def succeeded(outcome: Outcome, new: bool) -> str:
    """The outcome of a run that returned ``outcome``; ``new`` when it claimed a new key."""
    if outcome.replayed:
        return "replayed"
    return "new" if new else "resumed"


_NOTHING: AbstractContextManager[object] = nullcontext()


class RunObservation:
    """One run of one key, as a context manager around it; this base records nothing.

    The engine calls :meth:`claimed` once it holds the key, enters :meth:`phase` around
    each phase it runs, and passes the response through :meth:`finished`; a run that
    raises leaves through ``__exit__`` with the error.
    """

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        """The run holds key record ``key_id``, at recovery point ``point``; ``attempt``
        counts from 1; ``new`` when this run created the key."""

    def phase(self, point: str, atomic: bool) -> AbstractContextManager[object]:
        """Around one phase: an atomic phase until its COMMIT (serialization retries
        included), a foreign step around its call. Leaves with the phase's error, if any."""
        return _NOTHING

    def finished(self, outcome: Outcome) -> Outcome:
        """The run returns ``outcome``; returns it."""
        return outcome


NO_RUN = RunObservation()


class Observer:
    """Receives every event; each method does nothing. Subclass and override."""

    # -- the request path -------------------------------------------------------------

    def run(
        self, operation: str, version: int, *, by: str, scope: str | None, key: str | None
    ) -> RunObservation:
        """A run begins: ``by`` is :data:`CLIENT` or :data:`COMPLETER`; ``scope`` and
        ``key`` (unchecked yet, ``None`` for the completer) are for observers that record
        them on request only."""
        return NO_RUN

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        """A transaction hit a serialization failure or deadlock and runs again."""

    def serialization_exhausted(self, sqlstate: str | None) -> None:
        """A transaction ran out of retries: the run raises ConcurrentUpdate."""

    def trace_context(self) -> str | None:
        """A W3C ``traceparent`` to store with a job staged now, if any."""
        return None

    def job_staged(self, operation: str, job: str) -> None:
        """A job named ``job`` committed with its phase."""

    # -- the workers ----------------------------------------------------------------------

    def publishing(
        self, job: str, job_key: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        """Around the enqueuer's publish of one job."""
        return _NOTHING

    def job_published(self, job: str, lag: float) -> None:
        """A job was handed to the backend ``lag`` seconds after it was staged."""

    def job_publish_failed(self, job: str) -> None:
        """A publish raised; the job stays staged and backs off."""

    def job_unknown(self, job: str) -> None:
        """The job backend has no handler for a job named ``job``
        (:class:`~recoverypoint.jobs.UnknownJob`); it stays staged and backs off."""

    def key_abandoned(self, operation: str) -> None:
        """The completer gave a key up after its last attempt."""

    def keys_unfinishable(self, operation: str, keys: int) -> None:
        """A completer's pass found ``keys`` unfinished keys of ``operation`` due at versions
        no running completer registers: no worker can finish them. Told on every pass that
        finds some, and with 0 on the first pass that finds none after one that did."""

    def key_compensated(self, operation: str, ok: bool) -> None:
        """The completer ran an abandoned key's compensation: it committed (``ok``), or
        it raised and is tried again later."""

    def reaped(self, finished: int, abandoned: int, messages: int) -> None:
        """A reaper pass deleted these finished keys, abandoned keys and consume-once records."""

    def worker_pass(self, worker: str) -> None:
        """A worker ("completer", "enqueuer", "reaper") finished a pass."""

    # -- consumers ------------------------------------------------------------------------

    def consuming(
        self, consumer: str, message_id: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        """Around :func:`~recoverypoint.jobs.consume_once`."""
        return _NOTHING

    def consumed(self, consumer: str, processed: bool) -> None:
        """``consume_once`` decided: ``processed`` first time, else a duplicate."""


NO_OBSERVER = Observer()


def combine(*observers: Observer) -> Observer:
    """One observer that hands every event to each of ``observers``, in order."""
    if not observers:
        return NO_OBSERVER
    if len(observers) == 1:
        return observers[0]
    # Each one isolated: one that fails does not keep the others from hearing the event.
    return _Observers([isolated(o) for o in observers])


class _Observers(Observer):
    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def run(
        self, operation: str, version: int, *, by: str, scope: str | None, key: str | None
    ) -> RunObservation:
        return _RunObservations(
            [o.run(operation, version, by=by, scope=scope, key=key) for o in self.observers]
        )

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        for o in self.observers:
            o.serialization_retry(attempt, sqlstate)

    def serialization_exhausted(self, sqlstate: str | None) -> None:
        for o in self.observers:
            o.serialization_exhausted(sqlstate)

    def trace_context(self) -> str | None:
        for o in self.observers:
            found = o.trace_context()
            if found is not None:
                return found
        return None

    def job_staged(self, operation: str, job: str) -> None:
        for o in self.observers:
            o.job_staged(operation, job)

    def publishing(
        self, job: str, job_key: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        return _All([o.publishing(job, job_key, trace_context) for o in self.observers])

    def job_published(self, job: str, lag: float) -> None:
        for o in self.observers:
            o.job_published(job, lag)

    def job_publish_failed(self, job: str) -> None:
        for o in self.observers:
            o.job_publish_failed(job)

    def job_unknown(self, job: str) -> None:
        for o in self.observers:
            o.job_unknown(job)

    def key_abandoned(self, operation: str) -> None:
        for o in self.observers:
            o.key_abandoned(operation)

    def keys_unfinishable(self, operation: str, keys: int) -> None:
        for o in self.observers:
            o.keys_unfinishable(operation, keys)

    def key_compensated(self, operation: str, ok: bool) -> None:
        for o in self.observers:
            o.key_compensated(operation, ok)

    def reaped(self, finished: int, abandoned: int, messages: int) -> None:
        for o in self.observers:
            o.reaped(finished, abandoned, messages)

    def worker_pass(self, worker: str) -> None:
        for o in self.observers:
            o.worker_pass(worker)

    def consuming(
        self, consumer: str, message_id: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        return _All([o.consuming(consumer, message_id, trace_context) for o in self.observers])

    def consumed(self, consumer: str, processed: bool) -> None:
        for o in self.observers:
            o.consumed(consumer, processed)


class _RunObservations(RunObservation):
    def __init__(self, runs: list[RunObservation]) -> None:
        self.runs = runs
        self._scopes = _All(list(runs))

    def __enter__(self) -> Self:
        self._scopes.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scopes.__exit__(exc_type, exc, tb)

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        for run in self.runs:
            run.claimed(key_id, point, attempt, new)

    def phase(self, point: str, atomic: bool) -> AbstractContextManager[object]:
        return _All([run.phase(point, atomic) for run in self.runs])

    def finished(self, outcome: Outcome) -> Outcome:
        for run in self.runs:
            run.finished(outcome)
        return outcome


class _All(AbstractContextManager[object]):
    """Every scope entered, the first outermost (an ExitStack on ``with``)."""

    def __init__(self, scopes: list[AbstractContextManager[object]]) -> None:
        self._scopes = scopes
        self._stack = ExitStack()

    def __enter__(self) -> object:
        for scope in self._scopes:
            self._stack.enter_context(scope)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return bool(self._stack.__exit__(exc_type, exc, tb))


def isolated(observer: Observer) -> Observer:
    """``observer``, its failures logged and swallowed: what it raises, from an event or
    from entering or leaving a scope, never reaches the work it observes, and a scope
    cannot swallow the work's own error. :data:`NO_OBSERVER` is returned as it is."""
    if observer is NO_OBSERVER or isinstance(observer, _Isolated):
        return observer
    return _Isolated(observer)


# What was logged already: (observer's class, hook, error's class). A failing exporter
# fails on every request; its first failure says everything.
_reported: set[tuple[str, str, str]] = set()


def _report(observer: object, hook: str, exc: Exception) -> None:
    kind = (type(observer).__qualname__, hook, type(exc).__qualname__)
    if kind in _reported:
        return
    _reported.add(kind)
    logger.error(
        "observer %s failed in %s; the work goes on unobserved there (further %s errors "
        "of this hook are not logged)",
        kind[0],
        hook,
        kind[2],
        exc_info=exc,
    )


def _attempt(observer: object, hook: str, call: Callable[[], T]) -> T | None:
    try:
        return call()
    except Exception as exc:
        _report(observer, hook, exc)
        return None


class _IsolatedScope(AbstractContextManager[object]):
    """A scope of an observer's: entered and left in isolation, never swallowing."""

    def __init__(self, observer: object, hook: str, make: Callable[[], Any]) -> None:
        self._observer, self._hook = observer, hook
        self._scope: Any = _attempt(observer, hook, make)
        self._entered = False

    def __enter__(self) -> object:
        if self._scope is not None:
            self._entered = _attempt(self._observer, self._hook, self._enter) is not None
        return self

    def _enter(self) -> bool:
        self._scope.__enter__()
        return True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._entered:
            _attempt(self._observer, self._hook, lambda: self._scope.__exit__(exc_type, exc, tb))


class _IsolatedRun(RunObservation):
    def __init__(self, observer: Observer, run: Callable[[], RunObservation]) -> None:
        self._observer = observer
        self._scope = _IsolatedScope(observer, "run", run)

    def __enter__(self) -> Self:
        self._scope.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scope.__exit__(exc_type, exc, tb)

    @property
    def _run(self) -> Any:
        return self._scope._scope

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        if self._run is not None:
            run = self._run
            _attempt(self._observer, "claimed", lambda: run.claimed(key_id, point, attempt, new))

    def phase(self, point: str, atomic: bool) -> AbstractContextManager[object]:
        if self._run is None:
            return _NOTHING
        run = self._run
        return _IsolatedScope(self._observer, "phase", lambda: run.phase(point, atomic))

    def finished(self, outcome: Outcome) -> Outcome:
        if self._run is not None:
            run = self._run
            _attempt(self._observer, "finished", lambda: run.finished(outcome))
        return outcome  # as the engine made it, whatever the observer returned


class _Isolated(Observer):
    """An observer whose every hook runs in isolation; see :func:`isolated`."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def _event(self, hook: str, call: Callable[[], object]) -> None:
        _attempt(self.observer, hook, call)

    def run(
        self, operation: str, version: int, *, by: str, scope: str | None, key: str | None
    ) -> RunObservation:
        o = self.observer
        return _IsolatedRun(o, lambda: o.run(operation, version, by=by, scope=scope, key=key))

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        self._event(
            "serialization_retry", lambda: self.observer.serialization_retry(attempt, sqlstate)
        )

    def serialization_exhausted(self, sqlstate: str | None) -> None:
        self._event(
            "serialization_exhausted", lambda: self.observer.serialization_exhausted(sqlstate)
        )

    def trace_context(self) -> str | None:
        found = _attempt(self.observer, "trace_context", self.observer.trace_context)
        # Stored with a staged job: anything but text would fail the phase's COMMIT.
        return found if isinstance(found, str) else None

    def job_staged(self, operation: str, job: str) -> None:
        self._event("job_staged", lambda: self.observer.job_staged(operation, job))

    def publishing(
        self, job: str, job_key: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        o = self.observer
        return _IsolatedScope(o, "publishing", lambda: o.publishing(job, job_key, trace_context))

    def job_published(self, job: str, lag: float) -> None:
        self._event("job_published", lambda: self.observer.job_published(job, lag))

    def job_publish_failed(self, job: str) -> None:
        self._event("job_publish_failed", lambda: self.observer.job_publish_failed(job))

    def job_unknown(self, job: str) -> None:
        self._event("job_unknown", lambda: self.observer.job_unknown(job))

    def key_abandoned(self, operation: str) -> None:
        self._event("key_abandoned", lambda: self.observer.key_abandoned(operation))

    def keys_unfinishable(self, operation: str, keys: int) -> None:
        self._event("keys_unfinishable", lambda: self.observer.keys_unfinishable(operation, keys))

    def key_compensated(self, operation: str, ok: bool) -> None:
        self._event("key_compensated", lambda: self.observer.key_compensated(operation, ok))

    def reaped(self, finished: int, abandoned: int, messages: int) -> None:
        self._event("reaped", lambda: self.observer.reaped(finished, abandoned, messages))

    def worker_pass(self, worker: str) -> None:
        self._event("worker_pass", lambda: self.observer.worker_pass(worker))

    def consuming(
        self, consumer: str, message_id: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        o = self.observer
        return _IsolatedScope(
            o, "consuming", lambda: o.consuming(consumer, message_id, trace_context)
        )

    def consumed(self, consumer: str, processed: bool) -> None:
        self._event("consumed", lambda: self.observer.consumed(consumer, processed))
