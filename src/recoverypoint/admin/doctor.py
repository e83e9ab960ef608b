"""``doctor``: is this database ready for recoverypoint, and is anything piling up?

Each check says ``ok``, ``warn`` (works, but look at it) or ``fail`` (recoverypoint cannot
work as it is), with what to do next. A check that cannot run for want of an earlier one
(no connection, no schema) is not run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from ..migrate import VERSION_TABLE, history
from ..running import late
from .base import NEEDS_RECONCILIATION, STUCK, Admin
from .keys import BROKEN, nearing_windows, stats
from .unfinishable import UnfinishableKeys, unfinishable

OK, WARN, FAIL = "ok", "warn", "fail"
TABLES = ("idempotency_keys", "staged_jobs")
MAX_SKEW = 2.0
"""Seconds between this host's clock and the database's before the doctor warns."""
OLD_JOB = 300.0
"""Seconds a staged job may wait before the doctor asks whether an enqueuer runs."""
WORKERS = ("completer", "enqueuer", "reaper")

_PASSES = sa.text(
    """
    SELECT worker, host, pid, extract(epoch FROM now() - last_pass_at)::float8 AS age,
           last_error, interval_seconds
    FROM worker_passes ORDER BY last_pass_at DESC
    """
)


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    hint: str = ""


def diagnose(admin: Admin) -> list[Check]:
    """Run every check, in order; stops after the database or schema check fails."""
    checks: list[Check] = []
    for run in _CHECKS:
        check = run(admin)
        checks.append(check)
        if check.status == FAIL and run in (_database, _schema):
            break
    return checks


def _database(admin: Admin) -> Check:
    url = admin.db.url.render_as_string(hide_password=True)
    try:
        with admin.db.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version")).scalar_one()
    except DBAPIError as exc:
        detail = " ".join(str(exc.orig or exc).split())
        return Check("database", FAIL, f"{url}: {detail}", "check the URL, the server and the role")
    return Check("database", OK, f"{url}: PostgreSQL {version}")


def schema_revision(conn: sa.Connection) -> tuple[str | None, str]:
    """The schema's revision in the database (``None``: not migrated) and this version's head."""
    head = history().head
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None, head
    current = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    return current, head


def _schema(admin: Admin) -> Check:
    with admin.db.connect() as conn:
        current, head = schema_revision(conn)
    if current is None:
        return Check("schema", FAIL, "not migrated", "run `recoverypoint migrate`")
    known = history().revisions
    if current == head:
        return Check("schema", OK, f"at revision {head} (head)")
    if current not in known:
        # A newer recoverypoint migrated it: its schema still holds ours.
        return Check(
            "schema",
            WARN,
            f"at revision {current}, newer than this version's {head}",
            "upgrade recoverypoint here",
        )
    return Check(
        "schema", FAIL, f"at revision {current}, head is {head}", "run `recoverypoint migrate`"
    )


def _clock(admin: Admin) -> Check:
    with admin.db.connect() as conn:
        before = time.time()
        server = conn.execute(sa.text("SELECT extract(epoch FROM clock_timestamp())::float8"))
        after = time.time()
        skew = float(server.scalar_one()) - (before + after) / 2
    detail = f"this host is {abs(skew):.3f}s {'behind' if skew > 0 else 'ahead of'} the database"
    if abs(skew) > MAX_SKEW:
        return Check(
            "clock",
            WARN,
            detail,
            "leases run on the database's clock, so keys are "
            "safe; sync this host with NTP so logs and timestamps line up",
        )
    return Check("clock", OK, detail)


_AUTOVACUUM = sa.text(
    """
    SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), '') AS options,
           s.n_live_tup, s.n_dead_tup
    FROM pg_class AS c
    LEFT JOIN pg_stat_user_tables AS s ON s.relid = c.oid
    WHERE c.relname = ANY(CAST(:tables AS text[])) AND pg_table_is_visible(c.oid)
    ORDER BY c.relname
    """
)


def _autovacuum(admin: Admin) -> Check:
    with admin.db.connect() as conn:
        enabled = conn.execute(sa.text("SHOW autovacuum")).scalar_one() == "on"
        tables = list(conn.execute(_AUTOVACUUM, {"tables": list(TABLES)}))
    off = [
        t.relname
        for t in tables
        if "autovacuum_enabled=false" in t.options or "autovacuum_enabled=off" in t.options
    ]
    dead = ", ".join(f"{t.relname} {t.n_dead_tup or 0} dead of {t.n_live_tup or 0}" for t in tables)
    if not enabled:
        return Check(
            "autovacuum",
            WARN,
            f"autovacuum is off on the server ({dead})",
            "both tables churn (every key and job is deleted in the end): set "
            "autovacuum = on in postgresql.conf, or vacuum them on a schedule",
        )
    if off:
        return Check(
            "autovacuum",
            WARN,
            f"autovacuum is off for {', '.join(off)} ({dead})",
            "both tables churn: ALTER TABLE ... RESET (autovacuum_enabled)",
        )
    return Check("autovacuum", OK, f"on ({dead})")


def _jobs(admin: Admin) -> Check:
    figures = stats(admin)
    detail = f"{figures.staged_jobs} staged, {figures.failing_jobs} failing to publish"
    if figures.oldest_job is not None:
        detail += f", oldest {figures.oldest_job:.0f}s"
    if figures.failing_jobs or (figures.oldest_job or 0) > OLD_JOB:
        return Check(
            "staged jobs",
            WARN,
            detail,
            "is an enqueuer running? "
            "(`recoverypoint worker enqueuer`); see `recoverypoint jobs list --failing`",
        )
    return Check("staged jobs", OK, detail)


def _keys(admin: Admin) -> Check:
    figures = stats(admin)
    stuck, abandoned = figures.by_state[STUCK], figures.by_state["abandoned"]
    detail = f"{sum(figures.by_state.values())} keys, {stuck} stuck, {abandoned} abandoned"
    if figures.broken:
        return Check(
            "keys",
            FAIL,
            f"{detail}; {figures.broken} not whole (finished without a response, or "
            "abandoned without being finished)",
            "recoverypoint never writes such a row: something else wrote to "
            "idempotency_keys. Find the rows with `SELECT id, scope FROM idempotency_keys "
            "AS k WHERE " + " ".join(BROKEN.split()) + "`, and what wrote them; a retry "
            "of such a key fails until the row is fixed or deleted",
        )
    if stuck:
        return Check("keys", WARN, detail, "see `recoverypoint keys list --state stuck`")
    return Check("keys", OK, detail)


def _unfinishable(admin: Admin) -> Check:
    found = unfinishable(admin)
    if not found:
        running = f"{found.completers} completer{'' if found.completers == 1 else 's'} running"
        return Check("unfinishable", OK, f"none ({running})")
    jobs = [f"job {group.job}: {group.jobs} staged, no handler" for group in found.jobs]
    detail = "; ".join([*map(_described, found.keys), *jobs])
    stuck = any(group.keys for group in found.keys)
    if found.keys and not found.completers:
        # Every stuck key waits for a completer: the workers check says so too.
        detail = f"no completer is running: {detail}"
        if not found.jobs:
            return Check(
                "unfinishable",
                WARN,
                detail,
                "run `recoverypoint worker completer --app module:engine` (or `worker all`)",
            )
    if not stuck and not found.jobs:
        # Abandoned keys alone: every abandonment makes a compensation due, so a retired
        # version that declares none leaves these until the reaper deletes them.
        return Check(
            "unfinishable",
            WARN,
            detail,
            "no running completer registers these operation versions: if one declares a "
            "compensation, import the module that registers it from the workers' --app "
            "module (under Django, from an installed app's idempotency module) and restart "
            "the workers; a retired version that declares none owes nothing, and the "
            "reaper deletes its abandoned keys after their retention",
        )
    return Check(
        "unfinishable",
        FAIL,
        detail,
        "no running completer registers these operation versions (each records what it "
        "registers with its passes), or the job backend has no handler for these jobs: "
        "import the module that registers them from the workers' --app module (under "
        "Django, from an installed app's idempotency module) and restart the workers; "
        "`recoverypoint keys list --operation NAME` lists the keys",
    )


def _described(group: UnfinishableKeys) -> str:
    counts = []
    if group.keys:
        counts.append(f"{group.keys} stuck key{'' if group.keys == 1 else 's'}")
    if group.compensations:
        many = "" if group.compensations == 1 else "s"
        counts.append(f"{group.compensations} abandoned key{many} awaiting a compensation")
    return f"{group.operation} v{group.version}: {', '.join(counts)}"


def _windows(admin: Admin) -> Check:
    held = stats(admin, include_finished=False).by_state[NEEDS_RECONCILIATION]
    nearing = nearing_windows(admin)
    detail = (
        f"{held} keys need reconciliation, {nearing} near their step's dedupe window "
        "(of the operations known here)"
    )
    if held:
        return Check(
            "dedupe windows",
            WARN,
            detail,
            "their steps' providers forgot the first calls: see `recoverypoint keys list "
            "--state needs-reconciliation`, ask each provider, then `recoverypoint keys "
            "reconcile ID --found JSON` or `--not-found`",
        )
    if nearing:
        return Check(
            "dedupe windows",
            WARN,
            detail,
            "finish them before their windows pass (is the completer running? is a "
            "provider down?), or they will wait for reconciliation",
        )
    return Check("dedupe windows", OK, detail)


# Abandoned keys whose compensation raised and awaits another try (through the partial
# index of compensations due): their committed effects stay until a human looks.
_FAILING_COMPENSATIONS = sa.text(
    """
    SELECT count(*), min(k.abandoned_at) FROM idempotency_keys AS k
    WHERE k.compensation_due_at IS NOT NULL AND k.compensation_attempts > 0
      AND k.compensated_at IS NULL
    """
)


def _compensations(admin: Admin) -> Check:
    with admin.db.connect() as conn:
        failing, oldest = conn.execute(_FAILING_COMPENSATIONS).one()
    if failing:
        return Check(
            "compensations",
            WARN,
            f"{failing} abandoned keys' compensations failed (the oldest abandoned at "
            f"{oldest:%Y-%m-%d %H:%M:%S}); the completer tries them again, backed off",
            "fix the compensation (its error is each key's last_error: `recoverypoint keys "
            "list --state abandoned`), or undo those keys' effects by hand",
        )
    return Check("compensations", OK, "none failing")


@dataclass(frozen=True)
class WorkerPass:
    """A kind of worker's last pass, on whichever host ran it last."""

    worker: str
    host: str
    pid: int
    age: float
    """Seconds ago, on the database's clock."""
    last_error: str | None
    interval_seconds: float | None
    """The longest wait between its passes, as it recorded it; None for a single pass."""

    @property
    def late(self) -> bool:
        """Whether the next pass is overdue: the worker stopped, or hangs
        (:func:`recoverypoint.running.late`)."""
        return late(self.age, self.interval_seconds)


def worker_passes(admin: Admin) -> dict[str, WorkerPass]:
    """Each kind of worker's last pass (``recoverypoint worker`` records them), by kind."""
    with admin.db.connect() as conn:
        passes = conn.execute(_PASSES).all()
    latest: dict[str, WorkerPass] = {}
    for row in passes:  # newest first: the first row of a kind is its last pass
        latest.setdefault(row.worker, WorkerPass(**row._mapping))
    return latest


def _workers(admin: Admin) -> Check:
    latest = worker_passes(admin)
    missing = [kind for kind in WORKERS if kind not in latest]
    late = [kind for kind, row in latest.items() if row.late]
    failing = [kind for kind, row in latest.items() if row.last_error]
    detail = ", ".join(
        f"{kind} {row.age:.0f}s ago on {row.host} (pid {row.pid})"
        + (f", failing: {row.last_error}" if row.last_error else "")
        for kind, row in sorted(latest.items())
    )
    if missing or late or failing:
        problems = [*(f"no {kind} pass ever" for kind in missing), *(f"{k} late" for k in late)]
        return Check(
            "workers",
            WARN,
            "; ".join(filter(None, [", ".join(problems), detail])),
            "run `recoverypoint worker all --app module:engine` (or each worker); "
            "a failing pass logs event=error with what went wrong",
        )
    return Check("workers", OK, detail)


def _pooler(admin: Admin) -> Check:
    """Three transactions on one client connection: more than one server backend answering
    them means a pooler in transaction (or statement) mode sits in between."""
    with admin.db.connect() as conn:
        pids = set()
        for _ in range(3):
            with conn.begin():
                pids.add(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
    if len(pids) > 1:
        return Check(
            "pooler",
            WARN,
            "a pooler in transaction mode answers (server backends "
            f"{sorted(pids)} for one connection)",
            "each phase is one transaction, "
            "which fits; use PgBouncer >= 1.21 with max_prepared_statements, or "
            "connect_args={'prepare_threshold': None}",
        )
    return Check("pooler", OK, "none in transaction mode seen (one backend per connection)")


_CHECKS: tuple[Callable[[Admin], Check], ...] = (
    _database,
    _schema,
    _clock,
    _autovacuum,
    _workers,
    _jobs,
    _keys,
    _unfinishable,
    _windows,
    _compensations,
    _pooler,
)
