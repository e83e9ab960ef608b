"""Gauges read from the database at scrape time: the state every process shares.

A key's state is judged as ``recoverypoint keys`` judges it (:mod:`recoverypoint.admin`):
on the database's clock, with the lock timeout of the operation version that started it.
Two statements per scrape, each reading only what the partial indexes hold (unfinished
keys, abandoned keys) and the staged jobs, under a statement timeout: a slow database makes
one scrape report ``recoverypoint_collector_up 0``, not pile up queries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..admin import (
    ABANDONED,
    DEFAULT_STUCK_AFTER,
    IN_FLIGHT,
    NEEDS_RECONCILIATION,
    STUCK,
    Admin,
)
from ..admin._sql import REGISTERED, STATE
from ..operation import Operation

logger = logging.getLogger("recoverypoint.metrics")

# Unfinished keys by operation and state, and abandoned ones (which are finished) apart.
_KEYS = sa.text(
    f"""
    WITH {REGISTERED}
    SELECT k.operation, {STATE} AS state, count(*) AS keys,
           extract(epoch FROM now() - min(k.created_at))::float8 AS oldest
    FROM idempotency_keys AS k
    WHERE k.finished_at IS NULL
    GROUP BY 1, 2
    UNION ALL
    SELECT k.operation, 'abandoned', count(*), NULL
    FROM idempotency_keys AS k
    WHERE k.abandoned_at IS NOT NULL
    GROUP BY 1
    """
)

_JOBS = sa.text(
    """
    SELECT count(*) AS jobs, count(*) FILTER (WHERE attempts > 0) AS failing,
           coalesce(extract(epoch FROM now() - min(created_at))::float8, 0) AS oldest
    FROM staged_jobs
    """
)

_KEY_GAUGES = {
    "keys_in_flight": "Unfinished keys whose lease a request holds.",
    "keys_unfinished": "Keys without a response yet: in flight, stuck or waiting.",
    "keys_stuck": "Unfinished keys, lease free, next attempt overdue by more than stuck_after.",
    "keys_abandoned": "Abandoned keys not yet reaped.",
    "keys_needing_reconciliation": (
        "Unfinished keys held for an operator: a foreign step past its provider's dedupe "
        "window, with no reconcile hook (`recoverypoint keys reconcile`)."
    ),
    "oldest_unfinished_key_age_seconds": "Age of the oldest key without a response.",
}
_JOB_GAUGES = {
    "staged_jobs": "Jobs staged and not yet published.",
    "failing_staged_jobs": "Staged jobs whose publish failed at least once.",
    "oldest_staged_job_age_seconds": "Age of the oldest staged job: the enqueuer's lag.",
}


class DatabaseCollector(Collector):
    """The key and staged-job gauges, read from ``db`` at every scrape.

    Parameters
    ----------
    operations:
        The engine's registered operations (``engine.operations``): each of them has a
        series from the first scrape, even at 0 (a key's lease is judged by the lock
        timeout its holder stored). An operation met in the table keeps its series, at 0,
        once its keys are gone: a series that vanished and came back would hide the change
        from ``delta()`` and restart an alert's ``for``.
    stuck_after:
        How long past its next attempt an unleased key waits before it counts as stuck.
    timeout:
        Seconds a scrape's statements may run.
    """

    def __init__(
        self,
        db: sa.Engine,
        operations: Iterable[Operation[Any]] = (),
        *,
        stuck_after: timedelta = DEFAULT_STUCK_AFTER,
        timeout: float = 5.0,
    ) -> None:
        self._admin = Admin(db, tuple(operations), stuck_after=stuck_after)
        self._timeout_ms = int(timeout * 1000)
        self._met: frozenset[str] = frozenset(op.name for op in self._admin.operations)

    def describe(self) -> Iterable[Metric]:
        # Names only, so that registering never touches the database.
        return [_gauge(name, doc, labels) for name, doc, labels in _ALL]

    def collect(self) -> Iterator[Metric]:
        up = _gauge("collector_up", "1 when the last scrape read the database.", ())
        try:
            keys, jobs = self._read()
        except Exception:
            logger.exception("metrics: could not read the database")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._keys(keys)
        yield from _jobs(jobs)

    def _read(self) -> tuple[list[Any], Any]:
        with self._admin.db.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL statement_timeout = {self._timeout_ms}"))
            keys = list(conn.execute(_KEYS, self._admin.params()))
            jobs = conn.execute(_JOBS).one()
        return keys, jobs

    def _keys(self, rows: list[Any]) -> Iterator[Metric]:
        self._met = self._met | {row[0] for row in rows}  # one assignment: scrapes may overlap
        operations = sorted(self._met)
        values: dict[str, dict[str, float]] = {
            name: dict.fromkeys(operations, 0.0) for name in _KEY_GAUGES
        }
        for operation, state, keys, oldest in rows:
            if state == ABANDONED:
                values["keys_abandoned"][operation] += keys
                continue
            values["keys_unfinished"][operation] += keys
            if state == IN_FLIGHT:
                values["keys_in_flight"][operation] += keys
            elif state == STUCK:
                values["keys_stuck"][operation] += keys
            elif state == NEEDS_RECONCILIATION:
                values["keys_needing_reconciliation"][operation] += keys
            ages = values["oldest_unfinished_key_age_seconds"]
            ages[operation] = max(ages[operation], oldest)
        for name, doc in _KEY_GAUGES.items():
            gauge = _gauge(name, doc, ("operation",))
            for operation, value in values[name].items():
                gauge.add_metric([operation], value)
            yield gauge


def _jobs(row: Any) -> Iterator[Metric]:
    for name, value in zip(_JOB_GAUGES, (row.jobs, row.failing, row.oldest), strict=True):
        gauge = _gauge(name, _JOB_GAUGES[name], ())
        gauge.add_metric([], value)
        yield gauge


def _gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"recoverypoint_{name}", doc, labels=labels)


_ALL = [
    ("collector_up", "1 when the last scrape read the database.", ()),
    *((name, doc, ("operation",)) for name, doc in _KEY_GAUGES.items()),
    *((name, doc, ()) for name, doc in _JOB_GAUGES.items()),
]
