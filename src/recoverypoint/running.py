"""Which workers are running, and which operation versions the running completers can finish.

A worker is running while its next pass is not late: within three of its intervals
(interval plus jitter, as it recorded them) and half a minute, since a long pass delays the
next record; five minutes after a single pass (``--once``), or a record that says nothing of
its interval. ``worker_passes`` holds each kind of worker's last pass, which
``recoverypoint doctor`` and the console judge by this rule (:func:`late`).

Each completer also records, with every pass, the operation versions its application
registers, in ``completer_operations`` (one row per completer). A key of a version no
running completer registers is one no worker can finish: it waits until a completer whose
application registers it runs. Recorded in the database, so that a completer tells the keys
another running completer will finish (a deploy rolling from one version to the next, two
applications on one database) from those nobody can, and the doctor and the console report
those from any process, without loading the application. The next completer to record
forgets those no longer running.

The rule is written here once in Python (:func:`late`) and once in SQL (:data:`RUNNING`).
"""

from __future__ import annotations

OLD_PASS = 300.0
"""Seconds after a pass before the worker is late, when its interval is unknown (a single
pass, or a worker of a release before migration 0012)."""
LATE_AFTER_INTERVALS = 3
LATE_GRACE = 30.0


def late(age: float, interval: float | None) -> bool:
    """Whether a worker whose last pass was ``age`` seconds ago, and which said it would pass
    again within ``interval`` seconds (``None``: unknown), is late: stopped, or hanging."""
    if interval is None:
        return age > OLD_PASS
    return age > LATE_AFTER_INTERVALS * interval + LATE_GRACE


RUNNING = f"""
    (c.recorded_at >= now() - make_interval(secs => coalesce(
        {LATE_AFTER_INTERVALS} * c.interval_seconds + {LATE_GRACE}, {OLD_PASS})))
"""
"""SQL: whether the completer of ``completer_operations`` row ``c`` is running."""

KNOWN = f"""
    known AS (
        SELECT o.operation, o.version
        FROM completer_operations AS c
        CROSS JOIN LATERAL unnest(c.operations, c.versions) AS o(operation, version)
        WHERE {RUNNING}
    )
"""
"""SQL: the operation versions some running completer registers, as a table (a ``WITH``
entry)."""

RECORD = """
    INSERT INTO completer_operations
        (completer, host, pid, operations, versions, recorded_at, interval_seconds)
    VALUES (:completer, :host, :pid, CAST(:operations AS text[]), CAST(:versions AS integer[]),
            now(), :interval)
    ON CONFLICT (completer) DO UPDATE
    SET operations = excluded.operations, versions = excluded.versions,
        recorded_at = excluded.recorded_at, interval_seconds = excluded.interval_seconds
"""
"""SQL: a completer's record of what it can finish (``:operations`` at ``:versions``, the
bind parameters of :func:`recoverypoint.leases.registered`), and how long until its next
pass at the latest (``:interval``; NULL for a single pass)."""

FORGET_STOPPED = f"DELETE FROM completer_operations AS c WHERE NOT {RUNNING}"
"""SQL: forget the completers no longer running; what they registered counts no more."""
