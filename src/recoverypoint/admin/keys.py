"""Reading keys: list them with filters, show one in full, count them.

Every figure that depends on time (a state, a lease left, an age) is computed by the
database on its own clock, as the engine judges leases; never by the caller's clock.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from ..keys import downstream_key_of, record_material
from ..operation import FINISHED as FINISHED_POINT
from ..operation import STARTED, Operation, Phase
from ._sql import DETAIL_COLUMNS, KEY_COLUMNS, REGISTERED, STATE, where
from .base import ABANDONED, FINISHED, IN_FLIGHT, STATES, Admin, NotFound

_AN_ID = re.compile(r"[0-9]{1,18}")  # digits that fit a bigint


@dataclass(frozen=True)
class KeyFilter:
    """Which keys a listing (or a bulk action) takes; unset filters take every key."""

    ids: tuple[int, ...] = ()
    operation: str | None = None
    version: int | None = None
    scope: str | None = None
    key: str | None = None
    states: tuple[str, ...] = ()
    point: str | None = None
    since: datetime | None = None
    """Created at or after."""
    until: datetime | None = None
    """Created before."""
    status: int | None = None
    search: str | None = None
    """The client's idempotency key, or a key record's id (digits)."""
    before: int | None = None
    """Only keys older than the key with this id: the next page of a listing."""
    limit: int | None = 50
    """Newest first; ``None`` for no limit."""

    def __post_init__(self) -> None:
        unknown = set(self.states) - set(STATES)
        if unknown:
            raise ValueError(
                f"unknown state {sorted(unknown)[0]!r}: use one of {', '.join(STATES)}"
            )

    def is_empty(self) -> bool:
        """Whether no filter narrows the selection (``limit`` aside)."""
        return not self.criteria()

    def criteria(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        del values["limit"]
        for name in ("ids", "states"):
            values[name] = list(values[name]) or None
        criteria = {name: value for name, value in values.items() if value is not None}
        if self.search is not None:  # bound even when None: the search's SQL names it
            criteria["search_id"] = int(self.search) if _AN_ID.fullmatch(self.search) else None
        return criteria


@dataclass(frozen=True)
class KeyRow:
    """One key as a listing shows it. Seconds are relative to the database's clock."""

    id: int
    scope: str
    operation: str
    version: int
    key: str
    point: str
    state: str
    attempts: int
    next_attempt_at: datetime
    next_attempt_in: float
    """Negative when overdue."""
    locked_at: datetime | None
    lock_token: UUID | None
    lock_timeout: float | None
    """Seconds: the lease holder's (else the operation's, when known here); ``None`` when
    nobody here knows it (a lease taken before migration 0010)."""
    lease_left: float | None
    """Seconds until the lease expires, negative once expired; ``None`` when free, or
    when held with an unknown :attr:`lock_timeout` (then it is live: see :attr:`live`)."""
    status: int | None
    created_at: datetime
    age: float
    last_run_at: datetime
    finished_at: datetime | None
    abandoned_at: datetime | None
    last_error: str | None
    compensated_at: datetime | None
    """When the operation's compensation committed for the abandoned key."""
    compensation_due_at: datetime | None
    """When the completer may next run the abandoned key's compensation, if its operation
    declares one; ``None`` when none is awaited (compensated, or abandoned before
    compensations existed)."""
    compensation_attempts: int
    """How many times the compensation raised (its last error is :attr:`last_error`)."""

    @property
    def live(self) -> bool:
        """Whether a request holds the lease and nobody may take it over (as the database
        judged it: see :data:`~recoverypoint.admin._sql.LIVE`)."""
        return self.state == IN_FLIGHT

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


@dataclass(frozen=True)
class PhaseMark:
    """Where one declared phase of a key's operation stands for that key (the operation's
    own declaration is :class:`recoverypoint.operation.Phase`)."""

    point: str
    kind: str
    """``atomic`` or ``foreign``."""
    mark: str
    """``done``, ``current`` (the key's recovery point) or ``pending``."""
    downstream_key: str | None = None
    """A foreign step's ``step.downstream_key()`` (for a call without a name)."""


@dataclass(frozen=True)
class Job:
    """A staged job, as ``staged_jobs`` holds it until the enqueuer publishes it."""

    id: int
    job_name: str
    job_args: Any
    job_key: str
    idempotency_key_id: int | None
    created_at: datetime
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    age: float


@dataclass(frozen=True)
class KeyDetail:
    """Everything about one key: what ``keys show`` prints."""

    row: KeyRow
    request_method: str
    request_path: str
    request_params: Any
    fingerprint: str
    phase_state: Any
    response_headers: Any
    response_body: Any
    known: bool
    """Whether the operation version is known here (its lock timeout and phases are)."""
    phases: tuple[PhaseMark, ...]
    jobs: tuple[Job, ...]
    lease_expires_at: datetime | None
    reaped_after: datetime | None
    """When the reaper may delete the key (finished keys only)."""
    compensation: str | None
    """What became of an abandoned key's committed effects (:func:`compensation`);
    ``None`` for a key that is not abandoned."""
    window: str | None = None
    """Where an unfinished key stands with the dedupe window of the step after its
    recovery point (:func:`window`); ``None`` when no window is in play."""


_SELECT = f"""
    WITH {REGISTERED}
    SELECT {KEY_COLUMNS} FROM idempotency_keys AS k
    WHERE {{where}}
    ORDER BY k.id DESC
    LIMIT :limit
"""

_DETAIL = f"""
    WITH {REGISTERED}
    SELECT {KEY_COLUMNS}, {DETAIL_COLUMNS} FROM idempotency_keys AS k
    WHERE {{where}}
"""

JOB_COLUMNS = """
    j.id, j.job_name, j.job_args, j.job_key, j.idempotency_key_id, j.created_at,
    j.attempts, j.next_attempt_at, j.last_error,
    extract(epoch FROM now() - j.created_at)::float8 AS age
"""

_JOBS_OF_KEY = sa.text(
    f"SELECT {JOB_COLUMNS} FROM staged_jobs AS j WHERE j.idempotency_key_id = :id ORDER BY j.id"
)

# A key row that is not whole: finished without its response (or the other way round), or
# abandoned without being finished. No statement of recoverypoint writes one (each sets
# those columns together); the table has no CHECK constraint for it, as a CHECK costs every
# write that much again (migration 0017), so doctor counts them in its scan of every key.
BROKEN = """
    (k.finished_at IS NULL) <> (k.response_status IS NULL)
    OR (k.abandoned_at IS NOT NULL AND k.finished_at IS NULL)
"""

STATS = f"""
    WITH {REGISTERED}
    SELECT k.operation, k.operation_version AS version, {STATE} AS state,
           k.recovery_point AS point, count(*) AS keys,
           extract(epoch FROM now() - min(k.created_at))::float8 AS oldest,
           count(*) FILTER (WHERE {BROKEN}) AS broken
    FROM idempotency_keys AS k
    WHERE {{where}}
    GROUP BY 1, 2, 3, 4
    ORDER BY 1, 2, 3, 4
"""

JOB_STATS = sa.text(
    """
    SELECT count(*) AS jobs, count(*) FILTER (WHERE attempts > 0) AS failing,
           count(*) FILTER (WHERE next_attempt_at <= now()) AS due,
           extract(epoch FROM now() - min(created_at))::float8 AS oldest
    FROM staged_jobs
    """
)


def list_keys(admin: Admin, filters: KeyFilter, *, reveal: bool = False) -> list[KeyRow]:
    """The keys ``filters`` selects, newest first (by id: ids are given in the order keys
    are claimed, and the primary key serves the order without a sort); scopes masked
    (:class:`Mask`) unless ``reveal``."""
    criteria = filters.criteria()
    sql = sa.text(_SELECT.format(where=where(criteria)))
    with admin.db.connect() as conn:
        result = conn.execute(sql, {**admin.params(), **criteria, "limit": filters.limit})
        rows = [KeyRow(**row._mapping) for row in result]
    return rows if reveal else [dataclasses.replace(r, scope=admin.mask(r.scope)) for r in rows]


def find_key(
    admin: Admin,
    key_id: int | None = None,
    *,
    scope: str | None = None,
    operation: str | None = None,
    key: str | None = None,
    reveal: bool = False,
) -> KeyDetail:
    """One key, by id or by its scope, operation and key; raises :class:`NotFound`.

    Unless ``reveal``, everything that may name a customer is masked (:class:`Mask`): the
    scope, the params, the phase outputs, the stored response's body and headers, and
    the request's fingerprint (a digest of the params that would confirm a guess)."""
    if key_id is not None:
        criteria: dict[str, Any] = {"ids": [key_id]}
        what = f"key {key_id}"
    elif scope is not None and operation is not None and key is not None:
        criteria = {"scope": scope, "operation": operation, "key": key}
        what = f"key {key!r} of operation {operation!r} in that scope"
    else:
        raise ValueError("name a key by its id, or by its scope, operation and key")
    with admin.db.connect() as conn:
        found = conn.execute(
            sa.text(_DETAIL.format(where=where(criteria))), {**admin.params(), **criteria}
        ).one_or_none()
        if found is None:
            raise NotFound(f"there is no {what}: list keys with `recoverypoint keys list`")
        jobs = tuple(Job(**j._mapping) for j in conn.execute(_JOBS_OF_KEY, {"id": found.id}))
    values = dict(found._mapping)
    seed, generation = values.pop("derivation_seed"), values.pop("generation")
    renewals, held_since = values.pop("window_renewals"), values.pop("reconcile_since")
    reached_at, point_age = values.pop("point_reached_at"), values.pop("point_age")
    detail = {name: values.pop(name) for name in _DETAIL_FIELDS}
    row = KeyRow(**values)
    # What StepContext.downstream_key() derives from: the same inputs.
    material = record_material(seed, row.id, row.created_at, row.operation, generation)
    if not reveal:
        row = dataclasses.replace(row, scope=admin.mask(row.scope))
        detail["fingerprint"] = admin.mask(detail["fingerprint"])
        for name in ("request_params", "phase_state", "response_headers", "response_body"):
            detail[name] = admin.mask.json(detail[name])
    operation_ = admin.operation(row.operation, row.version)
    step = renewed_step(operation_, row) if operation_ is not None else None
    return KeyDetail(
        row=row,
        **detail,
        phases=phases(operation_, row, material, renewals) if operation_ is not None else (),
        jobs=jobs,
        lease_expires_at=(
            row.locked_at + timedelta(seconds=row.lock_timeout)
            if row.locked_at and row.lock_timeout is not None
            else None
        ),
        reaped_after=_reaped_after(admin, row),
        compensation=compensation(row, operation_),
        window=window(row, step, held_since, reached_at, point_age),
    )


def renewed_step(operation: Operation[Any], row: KeyRow) -> Phase | None:
    """The foreign step with a dedupe window whose calls the key's ``window_renewals``
    count: the step after an unfinished key's recovery point; for a key that reached
    ``finished``, the step before it (FINISH keeps the count its result committed with);
    ``None`` when that is no such step."""
    points = [p.point for p in operation.phases]
    if row.point not in (STARTED, *points):
        return None
    at = points.index(row.point) if row.point != STARTED else -1
    index = at - 1 if row.point == FINISHED_POINT else at + 1
    step = operation.phases[index] if 0 <= index < len(points) else None
    return step if step is not None and step.dedupe_window is not None else None


def window(
    row: KeyRow,
    step: Phase | None,
    held_since: datetime | None,
    reached_at: datetime,
    point_age: float,
) -> str | None:
    """Where a key stands with the dedupe window of ``step`` (:func:`renewed_step`), in a
    sentence (what ``keys show`` and the console say): held for reconciliation since when
    and what to do, or when the window closes. ``None`` for a finished or abandoned key
    (no step of it will be called again) and when no window is in play."""
    if row.finished:
        return None
    if held_since is not None:
        what = f"foreign step {step.point!r}" if step else f"the foreign step after {row.point!r}"
        return (
            f"needs reconciliation since {held_since:%Y-%m-%d %H:%M:%S}: {what} is past its "
            "provider's dedupe window; find out what its last call did (its downstream key is "
            f"under phases), then run `recoverypoint keys reconcile {row.id} --found JSON` "
            "or `--not-found`"
        )
    if step is None or step.dedupe_window is None:
        return None
    closes = f"{reached_at + step.dedupe_window:%Y-%m-%d %H:%M:%S}"
    if point_age < step.dedupe_window.total_seconds():
        return f"the window of step {step.point!r} closes at {closes}"
    then = (
        "asks its reconcile hook what the last call did"
        if step.reconcile is not None
        else "holds the key for an operator's reconciliation (`recoverypoint keys reconcile`)"
    )
    return f"the window of step {step.point!r} closed at {closes}: the next attempt {then}"


def compensation_state(row: KeyRow, operation: Operation[Any] | None) -> str | None:
    """An abandoned key's compensation, in a word or three (what ``keys list`` shows):
    ``compensated``, ``compensation pending``, ``compensation failing``, ``not
    compensated``; with ``operation`` unknown (``None``), a key that would await one is
    ``compensation pending?``. ``None`` for a key that is not abandoned."""
    if row.abandoned_at is None:
        return None
    if row.compensated_at is not None:
        return "compensated"
    declared = operation is None or operation.compensation_phase is not None
    if row.compensation_due_at is None or not declared:
        return "not compensated"
    if row.compensation_attempts:
        return "compensation failing"
    return "compensation pending" + ("?" if operation is None else "")


def compensation(row: KeyRow, operation: Operation[Any] | None) -> str | None:
    """What became of the effects of an abandoned key's committed phases, in a sentence
    (what ``keys show`` says): :func:`compensation_state` and what it means."""
    state = compensation_state(row, operation)
    stay = (
        "no phase committed, there is nothing to undo"
        if row.point == STARTED
        else f"the effects of phases up to {row.point!r} stay, for a human to undo"
    )
    if state is None:
        return None
    if row.compensated_at is not None:
        return f"{state} at {row.compensated_at:%Y-%m-%d %H:%M:%S}"
    if state == "not compensated":
        return f"{state}: {stay}"
    if state == "compensation failing":
        return (
            f"{state} (failed tries: {row.compensation_attempts}): the completer tries it again "
            f"from {row.compensation_due_at:%Y-%m-%d %H:%M:%S}; its error is the last error"
        )
    if operation is None:
        return (
            "compensation pending if its operation declares one (the completer runs it; the "
            f"operation is not loaded here: pass --app), else not compensated: {stay}"
        )
    return f"{state}: the completer runs it"


_DETAIL_FIELDS = (
    "request_method",
    "request_path",
    "request_params",
    "fingerprint",
    "phase_state",
    "response_headers",
    "response_body",
    "known",
)


def phases(
    operation: Operation[Any], row: KeyRow, material: str, renewals: int = 0
) -> tuple[PhaseMark, ...]:
    """The declared phases, the key's point marked, each step's downstream key
    (``material``: the record's, see :func:`recoverypoint.keys.record_material`), the
    :func:`renewed_step`'s as its ``renewals`` made it (a fresh one per renewal)."""
    points = [STARTED, *(p.point for p in operation.phases)]
    at = points.index(row.point) if row.point in points else -1
    found: list[PhaseMark] = [PhaseMark(STARTED, "start", _mark(0, at))]
    for index, phase in enumerate(operation.phases, start=1):
        mark = _mark(index, at)
        downstream = None
        if not phase.atomic:
            # As StepContext.downstream_key() derives it.
            renewed = renewals if renewals and phase is renewed_step(operation, row) else 0
            downstream = downstream_key_of(material, phase.point, renewals=renewed)
        found.append(PhaseMark(phase.point, phase.kind, mark, downstream))
    return tuple(found)


def _mark(index: int, at: int) -> str:
    if at < 0:  # a point this version does not declare (see Operation.next_phase)
        return "unknown"
    return "done" if index < at else "current" if index == at else "pending"


def _reaped_after(admin: Admin, row: KeyRow) -> datetime | None:
    """As the reaper decides: the operation's own retention, else the reaper's; an
    abandoned key not before ``abandoned_retention`` either."""
    if row.finished_at is None:
        return None
    operation = admin.operation(row.operation, row.version)
    retention = (operation and operation.retention) or admin.retention
    after = row.finished_at + retention
    if row.abandoned_at is not None:
        return max(after, row.abandoned_at + admin.abandoned_retention)
    return after


@dataclass(frozen=True)
class StatsRow:
    operation: str
    version: int
    state: str
    point: str
    keys: int
    oldest: float
    """Age in seconds of the oldest key of the group."""
    broken: int = 0
    """Keys of the group whose row is not whole (:data:`BROKEN`)."""


@dataclass(frozen=True)
class Stats:
    groups: tuple[StatsRow, ...]
    """Counts by operation, version, state and recovery point."""
    by_state: dict[str, int]
    oldest_unfinished: float | None
    """Age in seconds of the oldest key not finished; ``None`` when there is none."""
    staged_jobs: int
    failing_jobs: int
    """Staged jobs whose publish failed at least once."""
    oldest_job: float | None
    due_jobs: int = 0
    """Staged jobs the enqueuer may publish now."""
    broken: int = 0
    """Key rows that are not whole (:data:`BROKEN`), among those read."""


NEARING = 0.75
"""The share of a step's dedupe window after which a key waiting before it is near it."""

# Unfinished keys waiting before a foreign step with a dedupe window (the windows of the
# operations known here), past NEARING of it and not held yet: a key judges its step's
# window from when its recovery point was reached (its creation, before migration 0013).
_NEARING = sa.text(
    """
    WITH w AS (
        SELECT * FROM unnest(
            CAST(:operations AS text[]), CAST(:versions AS integer[]),
            CAST(:points AS text[]), CAST(:windows AS double precision[])
        ) AS w(operation, version, point, seconds)
    )
    SELECT count(*) FROM idempotency_keys AS k
    JOIN w ON w.operation = k.operation AND w.version = k.operation_version
          AND w.point = k.recovery_point
    WHERE k.finished_at IS NULL AND k.reconcile_since IS NULL
      AND coalesce(k.point_reached_at, k.created_at)
          <= now() - make_interval(secs => w.seconds * :nearing)
    """
)


def nearing_windows(admin: Admin) -> int:
    """Unfinished keys past :data:`NEARING` of the dedupe window of the step they wait
    before, not yet held for reconciliation; of the operations ``admin`` knows."""
    windows = [
        (operation, point, phase.dedupe_window)
        for operation in admin.operations
        for point, phase in zip(
            (STARTED, *(p.point for p in operation.phases)), operation.phases, strict=False
        )
        if phase.dedupe_window is not None
    ]
    if not windows:
        return 0
    params = {
        "operations": [operation.name for operation, _, _ in windows],
        "versions": [operation.version for operation, _, _ in windows],
        "points": [point for _, point, _ in windows],
        "windows": [window.total_seconds() for _, _, window in windows],
        "nearing": NEARING,
    }
    with admin.db.connect() as conn:
        return int(conn.execute(_NEARING, params).scalar_one())


def stats(admin: Admin, *, include_finished: bool = True) -> Stats:
    """Counts of keys by operation, state and recovery point, and of staged jobs.

    Every key is read, unless ``include_finished`` is false: then only unfinished and
    abandoned keys are, through their partial indexes, however many finished ones the
    table holds (the console's overview; ``finished`` counts 0).
    """
    where = "true" if include_finished else "(k.finished_at IS NULL OR k.abandoned_at IS NOT NULL)"
    with admin.db.connect() as conn:
        found = conn.execute(sa.text(STATS.format(where=where)), admin.params())
        groups = tuple(StatsRow(**r._mapping) for r in found)
        jobs = conn.execute(JOB_STATS).one()
    by_state = dict.fromkeys(STATES, 0)
    for group in groups:
        by_state[group.state] += group.keys
    unfinished = [g.oldest for g in groups if g.state not in (FINISHED, ABANDONED)]
    return Stats(
        groups=groups,
        by_state=by_state,
        oldest_unfinished=max(unfinished, default=None),
        staged_jobs=jobs.jobs,
        failing_jobs=jobs.failing,
        oldest_job=jobs.oldest,
        due_jobs=jobs.due,
        broken=sum(group.broken for group in groups),
    )
