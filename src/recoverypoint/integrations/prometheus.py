"""Prometheus metrics (``pip install 'recoverypoint[metrics]'``).

Two parts, usually in one registry:

- :class:`PrometheusObserver` counts what this process does (requests, phases, retries,
  jobs, the workers' passes): pass it as ``Engine(observer=...)``;
- :class:`~recoverypoint.integrations.prometheus_collector.DatabaseCollector` reads the
  gauges every process shares (keys in flight, stuck, abandoned; staged jobs) from the
  database at scrape time. ``recoverypoint metrics serve`` serves it on its own.

::

    from prometheus_client import CollectorRegistry
    from recoverypoint.integrations.prometheus import (
        DatabaseCollector, MetricsApp, PrometheusObserver,
    )

    registry = CollectorRegistry()
    engine = rp.Engine(url, observer=PrometheusObserver(registry))
    registry.register(DatabaseCollector(engine.db, engine.operations))
    app.add_route("/metrics", MetricsApp(registry))   # or prometheus_client.make_wsgi_app

Labels are ``operation``, ``point``, ``outcome``, ``worker``, ``job`` and ``by``
(``client`` or ``completer``): each takes a handful of values. Never a key or a scope.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from time import perf_counter
from types import TracebackType
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_asgi_app,
)

from ..observe import CLIENT, Observer, RunObservation, outcome_of, succeeded
from ..operation import Outcome
from .prometheus_collector import DatabaseCollector

__all__ = ["DatabaseCollector", "MetricsApp", "PrometheusObserver"]

# Publishing lags behind staging by the enqueuer's interval (1 s) when all is well, and by
# minutes when it is down or a broker refuses jobs: buckets up to an hour.
_LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class MetricsApp:
    """``registry``'s metrics as an ASGI app answering at the very path it is routed to:
    ``app.add_route("/metrics", MetricsApp(registry))`` in FastAPI or Starlette.

    Mounted instead (``app.mount("/metrics", make_asgi_app(registry))``), it is reached at
    ``/metrics/`` only, and ``/metrics`` answers a 307 redirect that a scrape config or a
    curl may not follow. An object, not a function, so that a route runs it as an ASGI
    app rather than as a request handler.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._app = make_asgi_app(registry)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._app(scope, receive, send)


class _Metrics:
    """The instruments, registered once per registry."""

    def of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: ``labels()`` validates and takes a
        lock on every call, which adds up to tens of microseconds a request."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def __init__(self, registry: CollectorRegistry) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"recoverypoint_{name}", doc, labels, registry=registry)

        self.requests = counter(
            "requests", "Engine.run calls by how they ended.", "operation", "outcome"
        )
        self.request_seconds = Histogram(
            "recoverypoint_request_duration_seconds",
            "Engine.run wall time, claim to response.",
            ("operation", "outcome"),
            registry=registry,
        )
        self.completer_runs = counter(
            "completer_runs", "Keys the completer resumed, by how it ended.", "operation", "outcome"
        )
        self.finished_keys = counter(
            "finished_keys",
            "Keys run to a stored response, by who finished them.",
            "operation",
            "by",
        )
        self.phase_commits = counter(
            "phase_commits", "Atomic phases committed.", "operation", "point"
        )
        self.phase_seconds = Histogram(
            "recoverypoint_phase_duration_seconds",
            "Wall time of phases that completed, serialization retries included.",
            ("operation", "point"),
            registry=registry,
        )
        self.foreign_errors = counter(
            "foreign_step_errors", "Foreign steps that raised.", "operation", "point"
        )
        self.retries = counter(
            "serialization_retries",
            "Transactions run again after a serialization failure or deadlock.",
        )
        self.exhausted = counter(
            "serialization_retries_exhausted",
            "Transactions that ran out of retries (ConcurrentUpdate, 409).",
        )
        self.staged = counter("jobs_staged", "Jobs committed by atomic phases.", "job")
        self.published = counter("jobs_published", "Jobs the enqueuer published.", "job")
        self.publish_errors = counter(
            "job_publish_errors", "Publishes that failed; the job stays staged.", "job"
        )
        self.publish_lag = Histogram(
            "recoverypoint_job_publish_lag_seconds",
            "Seconds from a job's staging to its publish (database clock).",
            ("job",),
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.unknown_jobs = counter(
            "unknown_jobs",
            "Publishes of staged jobs the job backend has no handler for; they stay staged.",
            "job",
        )
        self.abandoned = counter("abandoned_keys", "Keys given up after max_attempts.", "operation")
        self.unfinishable = Gauge(
            "recoverypoint_unfinishable_keys",
            "Unfinished keys due that this process's completer found, on its last pass, at "
            "an operation version no running completer registers: no worker can finish them.",
            ("operation",),
            registry=registry,
        )
        self.compensations = counter(
            "compensations",
            "Compensations of abandoned keys run: committed, or failed (tried again later).",
            "operation",
            "outcome",
        )
        self.reaped_keys = counter("reaped_keys", "Finished keys the reaper deleted.", "outcome")
        self.reaped_messages = counter(
            "reaped_messages", "consume_once records the reaper deleted."
        )
        self.consumed = counter(
            "consume_once", "consume_once calls: processed or duplicate.", "job", "outcome"
        )
        self.last_pass = Gauge(
            "recoverypoint_worker_last_pass_timestamp_seconds",
            "Unix time of the worker's last completed pass in this process.",
            ("worker",),
            registry=registry,
        )


class PrometheusObserver(Observer):
    """Counts this process's events into ``registry`` (the default one if not given).

    One observer per registry: a second would register the same metric names again.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._m = _Metrics(registry)

    def run(
        self, operation: str, version: int, *, by: str, scope: str | None, key: str | None
    ) -> RunObservation:
        return _Run(self._m, operation, by)

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        self._m.retries.inc()

    def serialization_exhausted(self, sqlstate: str | None) -> None:
        self._m.exhausted.inc()

    def job_staged(self, operation: str, job: str) -> None:
        self._m.of(self._m.staged, job).inc()

    def job_published(self, job: str, lag: float) -> None:
        self._m.of(self._m.published, job).inc()
        self._m.of(self._m.publish_lag, job).observe(lag)

    def job_publish_failed(self, job: str) -> None:
        self._m.of(self._m.publish_errors, job).inc()

    def job_unknown(self, job: str) -> None:
        self._m.of(self._m.unknown_jobs, job).inc()

    def key_abandoned(self, operation: str) -> None:
        self._m.of(self._m.abandoned, operation).inc()

    def keys_unfinishable(self, operation: str, keys: int) -> None:
        self._m.of(self._m.unfinishable, operation).set(keys)

    def key_compensated(self, operation: str, ok: bool) -> None:
        self._m.of(self._m.compensations, operation, "committed" if ok else "failed").inc()

    def reaped(self, finished: int, abandoned: int, messages: int) -> None:
        self._m.of(self._m.reaped_keys, "finished").inc(finished)
        self._m.of(self._m.reaped_keys, "abandoned").inc(abandoned)
        self._m.reaped_messages.inc(messages)

    def worker_pass(self, worker: str) -> None:
        self._m.of(self._m.last_pass, worker).set_to_current_time()

    def consumed(self, consumer: str, processed: bool) -> None:
        self._m.of(self._m.consumed, consumer, "processed" if processed else "duplicate").inc()


class _Run(RunObservation):
    def __init__(self, metrics: _Metrics, operation: str, by: str) -> None:
        self._m = metrics
        self.operation = operation
        self._by = by
        self._new = False
        self._began = perf_counter()

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        self._new = new

    def phase(self, point: str, atomic: bool) -> AbstractContextManager[object]:
        return _Phase(self._m, self.operation, point, atomic)

    def finished(self, outcome: Outcome) -> Outcome:
        self._end(succeeded(outcome, self._new))
        if not outcome.replayed:
            self._m.of(self._m.finished_keys, self.operation, self._by).inc()
        return outcome

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._end(outcome_of(exc))

    def _end(self, outcome: str) -> None:
        if self._by == CLIENT:
            self._m.of(self._m.requests, self.operation, outcome).inc()
            seconds = perf_counter() - self._began
            self._m.of(self._m.request_seconds, self.operation, outcome).observe(seconds)
        else:
            self._m.of(self._m.completer_runs, self.operation, outcome).inc()


class _Phase(AbstractContextManager[object]):
    def __init__(self, metrics: _Metrics, operation: str, point: str, atomic: bool) -> None:
        self._m = metrics
        self._labels = (operation, point)
        self._atomic = atomic
        self._began = 0.0

    def __enter__(self) -> object:
        self._began = perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._m.of(self._m.phase_seconds, *self._labels).observe(perf_counter() - self._began)
            if self._atomic:
                self._m.of(self._m.phase_commits, *self._labels).inc()
        elif not self._atomic:
            self._m.of(self._m.foreign_errors, *self._labels).inc()
