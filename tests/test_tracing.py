"""OpenTelemetry traces, recorded by the SDK's in-memory exporter on a tracer provider of
the test's own (never the global one): the run span and its phases, the application's own
span nested in a phase, serialization retries as events, the enqueuer's send span in the
staging request's trace (through the traceparent stored with the job), and consume_once
linked to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from observing import conflicting_operation
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from rides import SCHEMA, Faults, Provider, ride_operation

import recoverypoint as rp
from recoverypoint.integrations.otel import OtelObserver
from recoverypoint.jobs import InProcessBackend, Job, consume_once
from recoverypoint.workers import Enqueuer

JOB = "send_ride_receipt"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def named(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def only(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> ReadableSpan:
    [span] = named(spans, name)
    return span


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest.mark.slow
def test_a_ride_is_one_trace_from_the_request_to_the_consumer(
    worker_db: sa.Engine, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    observer = OtelObserver(provider)
    app_tracer = provider.get_tracer("the application")
    consumed: list[Job] = []

    def send_receipt(job: Job) -> None:
        consumed.append(job)
        with worker_db.begin() as conn:
            consume_once(conn, JOB, job.job_key, observer=observer, trace_context=job.trace_context)

    faults = Faults()
    rides = ride_operation("traced_rides", Provider(worker_db), faults)
    engine = rp.Engine(worker_db, observer=observer, jobs=InProcessBackend({JOB: send_receipt}))
    engine.register(rides)

    def application_work() -> None:
        with app_tracer.start_as_current_span("the phase's own work"):
            pass

    faults.hooks["ride_created:start"] = application_work
    outcome = engine.run(
        rides, key="secret-key", scope="secret-scope", params={"scope": "secret-scope"}
    )
    assert outcome.status == 201
    Enqueuer(engine).run_once()
    assert len(consumed) == 1

    spans = exporter.get_finished_spans()
    run = only(spans, "recoverypoint.run traced_rides")
    assert run.parent is None and run.kind == SpanKind.INTERNAL
    attributes = dict(run.attributes or {})
    assert attributes == {
        "recoverypoint.operation": "traced_rides",
        "recoverypoint.operation.version": 1,
        "recoverypoint.by": "client",
        "recoverypoint.key_id": attributes["recoverypoint.key_id"],
        "recoverypoint.attempt": 1,
        "recoverypoint.recovery_point.start": "started",
        "recoverypoint.recovery_point.end": "finished",
        "recoverypoint.outcome": "new",
    }
    assert isinstance(attributes["recoverypoint.key_id"], int)
    # No scope and no key unless asked for.
    assert not any("secret" in str(v) for s in spans for v in (s.attributes or {}).values())

    phases = {p.name: p for p in spans if p.name.startswith("recoverypoint.phase ")}
    assert sorted(phases) == [
        "recoverypoint.phase charge_created",
        "recoverypoint.phase finished",
        "recoverypoint.phase ride_created",
    ]
    for phase in phases.values():
        assert parent_id(phase) == span_id(run)
    created = phases["recoverypoint.phase ride_created"]
    charge = phases["recoverypoint.phase charge_created"]
    finished = phases["recoverypoint.phase finished"]
    assert (created.attributes or {})["recoverypoint.phase.kind"] == "atomic"
    assert (charge.attributes or {})["recoverypoint.phase.kind"] == "foreign"
    # The phase's own spans nest under it: the phase span is current.
    assert parent_id(only(spans, "the phase's own work")) == span_id(created)

    # The receipt was staged in `finished`: the send span continues that trace from there.
    send = only(spans, f"recoverypoint.send {JOB}")
    assert send.kind == SpanKind.PRODUCER
    assert send.context is not None and run.context is not None
    assert send.context.trace_id == run.context.trace_id
    assert parent_id(send) == span_id(finished)
    assert (send.attributes or {})["messaging.message.id"] == consumed[0].job_key
    [stored] = [consumed[0].trace_context]
    assert stored is not None and f"{span_id(finished):016x}" in stored

    # The consumer's span: a child of the send span here (in-process), linked to the phase.
    consume = only(spans, f"recoverypoint.consume_once {JOB}")
    assert consume.kind == SpanKind.CONSUMER
    assert parent_id(consume) == span_id(send)
    assert [link.context.span_id for link in consume.links] == [span_id(finished)]
    assert (consume.attributes or {})["recoverypoint.duplicate"] is False

    # A redelivery in a consumer with no span of its own (a Celery worker, say) joins the
    # request's trace under the staging phase, marked a duplicate.
    exporter.clear()
    with worker_db.begin() as conn:
        assert not consume_once(
            conn, JOB, consumed[0].job_key, observer=observer, trace_context=stored
        )
    again = only(exporter.get_finished_spans(), f"recoverypoint.consume_once {JOB}")
    assert again.context is not None and again.context.trace_id == run.context.trace_id
    assert parent_id(again) == span_id(finished)
    assert [link.context.span_id for link in again.links] == [span_id(finished)]
    assert (again.attributes or {})["recoverypoint.duplicate"] is True

    # recoverypoint installed no provider of its own.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


@pytest.mark.slow
def test_a_failed_attempt_and_its_retry(
    worker_db: sa.Engine, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    observer = OtelObserver(provider, record_scope=True, record_key=True)
    faults = Faults()
    rides = ride_operation("retried_rides", Provider(worker_db), faults)
    engine = rp.Engine(worker_db, observer=observer, jobs=InProcessBackend({}))
    engine.register(rides)
    params: dict[str, Any] = {"scope": "s1"}

    faults.armed.add("charge_created:after_call")
    with pytest.raises(Exception, match="charge_created:after_call"):
        engine.run(rides, key="k", scope="s1", params=params)
    first = exporter.get_finished_spans()
    run = only(first, "recoverypoint.run retried_rides")
    assert run.status.status_code == StatusCode.ERROR
    assert (run.attributes or {})["recoverypoint.outcome"] == "failed"
    assert (run.attributes or {})["recoverypoint.recovery_point.end"] == "ride_created"
    assert (run.attributes or {})["recoverypoint.scope"] == "s1"  # opted in
    assert (run.attributes or {})["recoverypoint.idempotency_key"] == "k"
    charge = only(first, "recoverypoint.phase charge_created")
    assert charge.status.status_code == StatusCode.ERROR
    assert [e.name for e in charge.events] == ["exception"]

    exporter.clear()
    assert engine.run(rides, key="k", scope="s1", params=params).status == 201
    retry = only(exporter.get_finished_spans(), "recoverypoint.run retried_rides")
    assert {
        name: (retry.attributes or {})[f"recoverypoint.{name}"]
        for name in ("outcome", "attempt", "recovery_point.start", "recovery_point.end")
    } == {
        "outcome": "resumed",
        "attempt": 2,
        "recovery_point.start": "ride_created",
        "recovery_point.end": "finished",
    }
    assert retry.status.status_code == StatusCode.UNSET

    # A refusal is an answer, not a failure of the service: status left unset.
    exporter.clear()
    with pytest.raises(rp.ParamsMismatch):
        engine.run(rides, key="k", scope="s1", params={"scope": "other"})
    refused = only(exporter.get_finished_spans(), "recoverypoint.run retried_rides")
    assert (refused.attributes or {})["recoverypoint.outcome"] == "mismatch"
    assert refused.status.status_code == StatusCode.UNSET


@pytest.mark.slow
def test_serialization_retries_are_events_on_the_phase(
    worker_db: sa.Engine, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    conflicts = [2]
    engine = rp.Engine(worker_db, observer=OtelObserver(provider))
    bump = conflicting_operation("traced_bump", worker_db, conflicts)
    engine.register(bump)

    assert engine.run(bump, key="b", params={}).status == 200

    spans = exporter.get_finished_spans()
    bumped = only(spans, "recoverypoint.phase bumped")
    retries = [e for e in bumped.events if e.name == "recoverypoint.serialization_retry"]
    assert [(e.attributes or {})["recoverypoint.attempt"] for e in retries] == [1, 2]
    assert {(e.attributes or {})["db.response.status_code"] for e in retries} == {"40001"}
    assert parent_id(bumped) == span_id(only(spans, "recoverypoint.run traced_bump"))
