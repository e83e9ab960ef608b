"""OpenTelemetry traces (``pip install 'recoverypoint[otel]'``), through the API only.

:class:`OtelObserver` makes spans with the application's tracer provider (the global one
unless you pass another); recoverypoint never installs a provider or an SDK::

    engine = rp.Engine(url, observer=OtelObserver())

- ``recoverypoint.run <operation>``: one per :meth:`Engine.run` (and per key the completer
  resumes), with the operation, version, key record id, attempt, outcome and the recovery
  points it started and ended at;
- ``recoverypoint.phase <point>``: a child per phase, atomic or foreign; serialization
  retries are events on it. Spans are current, so the phase code's own spans nest under it;
- ``recoverypoint.send <job>`` (producer): the enqueuer's publish of a staged job, a child
  of the phase that staged it: its W3C ``traceparent`` is stored with the job;
- ``recoverypoint.consume_once <consumer>`` (consumer): linked to that phase too, and a
  child of the current span (the send span for the in-process backend; your consumer's span
  otherwise), or of the staging phase when there is none.

The scope and the client's idempotency key are recorded only when you opt in
(``record_scope=True``, ``record_key=True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..observe import Observer, RunObservation, outcome_of, succeeded
from ..operation import Outcome

__all__ = ["OtelObserver"]

_PROPAGATOR = TraceContextTextMapPropagator()
# Outcomes that are the service's failures; the others are answers to the client (a 409,
# a 422), which leave a span's status unset, as HTTP server spans do for 4xx.
_ERRORS = frozenset({"failed", "lock_lost"})


class OtelObserver(Observer):
    """Traces runs, phases, publishes and ``consume_once`` calls."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        record_scope: bool = False,
        record_key: bool = False,
    ) -> None:
        self._tracer = trace.get_tracer("recoverypoint", tracer_provider=tracer_provider)
        self._record_scope = record_scope
        self._record_key = record_key

    def run(
        self, operation: str, version: int, *, by: str, scope: str | None, key: str | None
    ) -> RunObservation:
        attributes: dict[str, Any] = {
            "recoverypoint.operation": operation,
            "recoverypoint.operation.version": version,
            "recoverypoint.by": by,
        }
        if self._record_scope and scope is not None:
            attributes["recoverypoint.scope"] = scope
        if self._record_key and key is not None:
            attributes["recoverypoint.idempotency_key"] = key
        return _Run(self._tracer, f"recoverypoint.run {operation}", attributes)

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        trace.get_current_span().add_event(
            "recoverypoint.serialization_retry",
            {"recoverypoint.attempt": attempt, "db.response.status_code": sqlstate or ""},
        )

    def serialization_exhausted(self, sqlstate: str | None) -> None:
        trace.get_current_span().add_event(
            "recoverypoint.serialization_retries_exhausted",
            {"db.response.status_code": sqlstate or ""},
        )

    def trace_context(self) -> str | None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")

    def publishing(
        self, job: str, job_key: str, trace_context: str | None
    ) -> AbstractContextManager[object]:
        # A child of the staging phase: the enqueuer has no trace of its own to continue.
        # A publish that raises is recorded on the span, its status an error.
        staged = _extract(trace_context)
        return self._tracer.start_as_current_span(
            f"recoverypoint.send {job}",
            context=staged,
            kind=SpanKind.PRODUCER,
            attributes=_message(job, job_key, "send"),
        )

    @contextmanager
    def consuming(
        self, consumer: str, message_id: str, trace_context: str | None
    ) -> Iterator[None]:
        staged = _extract(trace_context)
        links = []
        if staged is not None:
            links = [Link(trace.get_current_span(staged).get_span_context())]
        # The current span if there is one (the send span, the consumer framework's span),
        # else the staging phase: either way, in a trace that reaches the request.
        current = trace.get_current_span().get_span_context().is_valid
        with self._tracer.start_as_current_span(
            f"recoverypoint.consume_once {consumer}",
            context=None if current else staged,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=_message(consumer, message_id, "process"),
        ):
            yield

    def consumed(self, consumer: str, processed: bool) -> None:
        trace.get_current_span().set_attribute("recoverypoint.duplicate", not processed)


def _extract(trace_context: str | None) -> otel_context.Context | None:
    if not trace_context:
        return None
    staged = _PROPAGATOR.extract({"traceparent": trace_context})
    return staged if trace.get_current_span(staged).get_span_context().is_valid else None


def _message(name: str, message_id: str, operation: str) -> dict[str, Any]:
    return {
        "messaging.system": "recoverypoint",
        "messaging.operation.type": operation,
        "messaging.destination.name": name,
        "messaging.message.id": message_id,
    }


class _Run(RunObservation):
    """The run span, current from ``__enter__`` to ``__exit__``."""

    def __init__(self, tracer: trace.Tracer, name: str, attributes: dict[str, Any]) -> None:
        self._tracer = tracer
        self._scope = tracer.start_as_current_span(
            name,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        self._span: Span = trace.INVALID_SPAN
        self._new = False
        self._point: str | None = None

    def __enter__(self) -> _Run:
        self._span = self._scope.__enter__()
        return self

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        self._new = new
        self._point = point
        self._span.set_attributes(
            {
                "recoverypoint.key_id": key_id,
                "recoverypoint.recovery_point.start": point,
                "recoverypoint.attempt": attempt,
            }
        )

    def phase(self, point: str, atomic: bool) -> AbstractContextManager[object]:
        if not self._span.is_recording():
            # No SDK, or the run was not sampled: its phases would not be either, and making
            # their spans would only cost the request time.
            return nullcontext()
        return self._phase(point, atomic)

    @contextmanager
    def _phase(self, point: str, atomic: bool) -> Iterator[None]:
        with self._tracer.start_as_current_span(
            f"recoverypoint.phase {point}",
            attributes={
                "recoverypoint.phase": point,
                "recoverypoint.phase.kind": "atomic" if atomic else "foreign",
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield
            except BaseException as exc:
                _failed(span, exc)
                raise
        # Done: an atomic phase committed; a foreign step's result commits with the next
        # phase, or on its own should that fail.
        self._point = point

    def finished(self, outcome: Outcome) -> Outcome:
        self._span.set_attribute("recoverypoint.outcome", succeeded(outcome, self._new))
        if not outcome.replayed:
            self._point = "finished"
        return outcome

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            outcome = outcome_of(exc)
            self._span.set_attribute("recoverypoint.outcome", outcome)
            if outcome in _ERRORS:
                _failed(self._span, exc)
        if self._point is not None:
            self._span.set_attribute("recoverypoint.recovery_point.end", self._point)
        self._scope.__exit__(exc_type, exc, tb)


def _failed(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
