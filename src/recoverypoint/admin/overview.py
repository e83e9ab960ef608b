"""The overview: what an operator looks at first, read without reading every key.

A table of a million keys is mostly finished keys waiting for the reaper. Everything here
comes from the partial indexes of the unfinished and the abandoned keys, the index of
``finished_at`` (the last 24 hours only), the planner's estimate of the table's size, and
the small tables of staged jobs, worker passes and what the running completers register;
never from a scan of the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from .base import Admin
from .doctor import WorkerPass, worker_passes
from .keys import Stats, stats
from .unfinishable import Unfinishable, unfinishable

# One row per hour of the last 24, on the database's clock, the current hour last.
_HOURS = sa.text(
    """
    WITH hours AS (
        SELECT generate_series(date_trunc('hour', now()) - interval '23 hours',
                               date_trunc('hour', now()), interval '1 hour') AS hour
    ),
    finished AS (
        SELECT date_trunc('hour', finished_at) AS hour, count(*) AS keys
        FROM idempotency_keys
        WHERE finished_at >= date_trunc('hour', now()) - interval '23 hours'
        GROUP BY 1
    ),
    abandoned AS (
        SELECT date_trunc('hour', abandoned_at) AS hour, count(*) AS keys
        FROM idempotency_keys
        WHERE abandoned_at >= date_trunc('hour', now()) - interval '23 hours'
        GROUP BY 1
    )
    SELECT h.hour, coalesce(f.keys, 0) - coalesce(a.keys, 0) AS finished,
           coalesce(a.keys, 0) AS abandoned
    FROM hours AS h
    LEFT JOIN finished AS f ON f.hour = h.hour
    LEFT JOIN abandoned AS a ON a.hour = h.hour
    ORDER BY h.hour
    """
)

# How many keys: counted while the table is small (under 1000 pages, some 8 MB); above,
# the planner's rows per page (kept by ANALYZE and autovacuum) times the pages it has now,
# as the planner itself estimates; unknown for a big table never analyzed.
_ESTIMATE = sa.text(
    """
    SELECT CASE
        WHEN pg_relation_size(c.oid) < 1000 * current_setting('block_size')::bigint
            THEN (SELECT count(*) FROM idempotency_keys)
        WHEN c.reltuples > 0 AND c.relpages > 0
            THEN (c.reltuples / c.relpages
                  * (pg_relation_size(c.oid) / current_setting('block_size')::bigint))::bigint
    END
    FROM pg_class AS c WHERE c.oid = to_regclass('idempotency_keys')
    """
)


@dataclass(frozen=True)
class Hour:
    start: datetime
    finished: int
    """Keys that finished with their response in this hour."""
    abandoned: int
    """Keys the completer or an operator gave up in this hour."""


@dataclass(frozen=True)
class Overview:
    stats: Stats
    """Unfinished and abandoned keys by operation, state and point (finished: 0), and the
    staged jobs."""
    keys_estimate: int | None
    """About how many keys are stored, finished ones included (exact while few);
    ``None`` for a big table the planner has not analyzed yet."""
    hours: tuple[Hour, ...]
    """The last 24 hours, oldest first."""
    workers: dict[str, WorkerPass]
    unfinishable: Unfinishable
    """The keys and staged jobs no running worker can finish."""


def overview(admin: Admin) -> Overview:
    figures = stats(admin, include_finished=False)
    with admin.db.connect() as conn:
        estimate = conn.execute(_ESTIMATE).scalar()
        hours = tuple(Hour(row.hour, row.finished, row.abandoned) for row in conn.execute(_HOURS))
    return Overview(figures, estimate, hours, worker_passes(admin), unfinishable(admin))
