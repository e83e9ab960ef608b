"""Prove an operation crash-safe: run it once per crash schedule and check every invariant.

recoverypoint's own bookkeeping is exactly-once; whether *your* operation is also depends
on your code: a foreign step that forgets ``step.downstream_key()``, a provider that does
not dedupe on it, a phase that writes outside its transaction, a consumer that does not
call :func:`~recoverypoint.jobs.consume_once`. :func:`explore` finds those before
production. It runs the operation with a crash at every boundary the engine has
(:data:`recoverypoint.testing.BOUNDARIES`), as an exception and as the death of its
process (``os._exit``: no rollback, the lease left held), then lets it recover as it
would in production (the client retries, or the completer finishes the key; the enqueuer
publishes the staged jobs), with crashes during that recovery too, up to ``depth``
crashes per schedule. It meets the database's faults too: a storm of serialization
failures before a COMMIT, a COMMIT whose answer is lost, the engine's connections ended
during a foreign step, a lease run out under a slow step and the key taken over, and a
failover to a standby that lags, which loses the last committed phase (the tables its
commit wrote put back as they were before it) while what the foreign steps did at their
providers stays. Between schedules it truncates recoverypoint's tables and yours.

Attempts run in processes forked from explore's, which never runs the operation: a new
one for a schedule's first attempt and another after each crash, so that, as in
production (the client's retry reaches another server, the completer is a process
apart), what a crashed attempt kept in memory never reaches its recovery. An operation
that hands a value from one phase to the next in process memory (a module-level dict, a
cache) instead of ``tx.state`` fails there; when the same schedule holds with the crashed
attempt's process recovering the key, the report says so.

A foreign step that declares its provider's ``dedupe_window`` is also crashed around
(``before_foreign``, ``after_foreign``) in schedules where recovery comes only after the
window has passed (:class:`recoverypoint.testing.Clock` moves every stored moment back by
the window): with a ``reconcile`` hook the key must finish, your ``check`` judging the
effect; without one it must wait for an operator (``needs-reconciliation``), an outcome
the report counts and names ``recoverypoint keys reconcile`` for. In both, the step must
not be called again unless its hook found nothing. Every other schedule moves only the
leases and back-offs (``_STATE``), never every moment: that would carry its key past a
window or a finished key past its retention, and change what a retry or a replay does.

After each schedule it checks recoverypoint's invariants (the key finishes; every answer
a client got, and every replay, is the same (after a failover, those given since: the
earlier ones were lost with their phase); no lease is left; each staged job was
published and consumed through ``consume_once``) and yours (``check``). The smallest
failing schedule is reported with what each attempt did, the broken invariant, what the
database held, a hint where the guarantee ended, and the schedule in one line to paste
into ``explore(..., schedule=...)``. Schedules are enumerated in a fixed order, so the
same operation gives the same report; ``seed`` only orders a sample (``max_schedules``).
The search is breadth first and ends with the depth that found a failure: the summary
names the depth it reached.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, BinaryIO, Literal

import psycopg
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from . import _failover
from ._faults import FAULT_EXIT_STATUS, Effect, InjectedFault, faults
from .engine import Engine, heartbeat
from .integrations._base import is_single_step
from .jobs import Job, JobBackend
from .operation import NotFound, Operation, Outcome
from .testing import Clock
from .workers import Completer, Enqueuer

Recovery = Literal["client", "completer"]
# What a crash does: a fault registry's effect, or one explore brings about itself: the
# engine's connections ended during a foreign step (a failover, pg_terminate_backend); a
# lease run out while a step was slow, another attempt taking the key over; a failover to
# a standby that lags, which loses a commit and what followed it.
Kind = Effect | Literal["disconnect", "lease_lost", "failover"]
Check = Callable[[sa.Connection], None]
# Every kind, tried in this order at each boundary; the two that end an attempt's process.
KINDS: tuple[Kind, ...] = (
    "raise",
    "exit",
    "conflict",
    "lost_answer",
    "disconnect",
    "lease_lost",
    "failover",
)
KILLING: tuple[Kind, ...] = ("exit", "failover")

KEY = "explore"
# recoverypoint's tables that one schedule writes (its schema and namespace stay).
_OWN_TABLES = ("idempotency_keys", "staged_jobs", "processed_messages")
# Attempts after the first before a key that never finishes is given up on.
_RECOVERY_ATTEMPTS = 4
_ROWS_SHOWN = 10
# What a person needs of recoverypoint's own rows (the rest is in the tables' docs).
_SHOWN = {
    "idempotency_keys": "id, recovery_point, response_status, attempts, "
    "locked_at IS NOT NULL AS leased, last_error",
    "staged_jobs": "job_name, job_key, attempts, last_error",
    "processed_messages": "consumer, message_id",
}

# Time passes (leases expire, backoffs end, as they would while a client waits), and
# where the key and its jobs stand, in one round trip; the SELECT reads the rows as they
# were, which the UPDATEs change in nothing it reads. A key held for reconciliation stays
# held: only an operator makes it due.
_STATE = sa.text(
    """
    WITH expired AS (
        UPDATE idempotency_keys SET locked_at = locked_at - interval '366 days',
            next_attempt_at = least(next_attempt_at, now())
        WHERE finished_at IS NULL AND reconcile_since IS NULL
    ), due AS (
        UPDATE staged_jobs SET next_attempt_at = now() WHERE next_attempt_at > now()
    )
    SELECT k.id IS NOT NULL AS stored, k.recovery_point, k.response_status,
        k.locked_at IS NOT NULL AS leased, k.last_error, k.abandoned_at IS NOT NULL AS abandoned,
        k.reconcile_since IS NOT NULL AS held,
        (SELECT count(*) FROM staged_jobs) AS staged
    FROM (SELECT 1) AS one
    LEFT JOIN idempotency_keys AS k ON k.operation = :operation AND k.operation_version = :version
    """
)
# The sequences behind the tables' identity and serial columns, restarted between schedules
# so that every schedule sees the same ids.
_SEQUENCES = sa.text(
    """
    SELECT pg_get_serial_sequence(t, a.attname)
    FROM unnest(CAST(:tables AS text[])) AS t
    JOIN pg_attribute AS a ON a.attrelid = CAST(t AS regclass) AND a.attnum > 0
    WHERE NOT a.attisdropped AND pg_get_serial_sequence(t, a.attname) IS NOT NULL
    """
)
# Transactions left open on the database by others than this exploration's connection.
_OPEN_TRANSACTIONS = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
)
_ROLLBACK_POLLS = 5000
_CONSUMED = sa.text("SELECT message_id FROM processed_messages WHERE message_id = ANY(:keys)")
_CRASH = re.compile(
    r"attempt ([1-9]\d*) (raises|dies|loses its commit's answer|loses its connections"
    r"|loses its lease|loses its last commit to a failover"
    r"|meets ([1-9]\d*) serialization failures?)"
    r" at (\S+?)(?: \(hit ([1-9]\d*)\))?"
)
# A storm: serialization failures in a row at a phase, each rolling it back, the engine
# running it again each time (within its serialization_retries, 10 unless configured).
_STORM = 3
# What each crash does, as a schedule writes it; a storm's verb says how many failures.
_VERBS: dict[Kind, str] = {
    "raise": "raises",
    "exit": "dies",
    "lost_answer": "loses its commit's answer",
    "disconnect": "loses its connections",
    "lease_lost": "loses its lease",
    "failover": "loses its last commit to a failover",
}
# The kinds tried as a schedule's one crash, each at the points it belongs to.
_FIRST_ONLY: dict[Kind, str] = {
    "lost_answer": "after_commit:",
    "disconnect": "before_foreign:",
    "lease_lost": "after_foreign:",
    "failover": "after_commit:",
}
# Ends the backends of the engine's connections; then, until none is left (pg_terminate_backend's
# own wait needs PostgreSQL 14), how many still are.
_TERMINATE = sa.text(
    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
    "FROM unnest(CAST(:pids AS int[])) AS pid"
)
_LEFT = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(CAST(:pids AS int[]))")
_GONE_WITHIN = 5.0  # seconds a terminated backend is given to go
_PAST_WINDOW = re.compile(r"past the window of (\S+)")
# How far past a step's dedupe window a window schedule's recovery comes.
_PAST = timedelta(seconds=1)
# A window schedule's first crash is around its step, where a call's answer may be lost.
_AROUND_STEP = ("before_foreign", "after_foreign")
_HELD = "needs reconciliation"


@dataclass(frozen=True)
class Crash:
    """The ``nth`` time ``attempt`` reaches fault point ``point``, it raises or dies, or
    (``conflict``, at a ``before_commit`` point) meets a serialization failure there, that
    time and the ``times - 1`` times after it that the engine runs the phase again, or
    (``lost_answer``, at an ``after_commit`` point) loses the answer to the COMMIT that
    went through: its caller sees the connection drop, or (``disconnect``, at a
    ``before_foreign`` point) has the engine's pooled connections ended, the step running
    on and the phase after it meeting a dead connection, or (``lease_lost``, at an
    ``after_foreign`` point) finds, its step returned, that its lease ran out while the step
    ran and that another attempt took the key over and ran meanwhile, or (``failover``, at
    an ``after_commit`` point) goes on, its commit not yet on the standby that is promoted
    at its next COMMIT (or as it ends): its process dies with the primary, and the
    database is back as it was before that commit, what the foreign steps did staying."""

    attempt: int
    point: str
    nth: int = 1
    effect: Kind = "raise"
    times: int = 1

    def __str__(self) -> str:
        verb = _VERBS.get(self.effect)
        if verb is None:
            verb = f"meets {self.times} serialization failure{'s' * (self.times > 1)}"
        hit = f" (hit {self.nth})" if self.nth > 1 else ""
        return f"attempt {self.attempt} {verb} at {self.point}{hit}"

    def fires(self, point: str, nth: int) -> bool:
        """Whether it fires at the ``nth`` hit of ``point``."""
        return point == self.point and self.nth <= nth < self.nth + self.times


@dataclass(frozen=True)
class Schedule:
    """Who recovers (the client, or the completer once the client gave up), where each
    attempt crashes, and whether the provider's dedupe window of step ``past_window``
    passes after the first attempt. Written as ``"completer: attempt 1 raises at
    after_foreign:charge"``, or ``"client: attempt 1 dies at after_foreign:charge; past
    the window of charge"``."""

    recovery: Recovery = "client"
    crashes: tuple[Crash, ...] = ()
    past_window: str | None = None

    def __str__(self) -> str:
        parts = [str(c) for c in self.crashes]
        if self.past_window is not None:  # where time moves: after attempt 1
            first = sum(1 for c in self.crashes if c.attempt == 1)
            parts.insert(first, f"past the window of {self.past_window}")
        return f"{self.recovery}: " + ("; ".join(parts) or "no crash")

    @property
    def depth(self) -> int:
        return len(self.crashes)

    def crash_in(self, attempt: int) -> Crash | None:
        return next((c for c in self.crashes if c.attempt == attempt), None)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """The schedule a report printed; raises ValueError on anything else."""
        recovery, sep, rest = text.partition(":")
        if not sep or recovery.strip() not in ("client", "completer"):
            raise ValueError(f"a schedule begins with 'client:' or 'completer:', got {text!r}")
        crashes = []
        past_window = None
        for part in filter(None, (p.strip() for p in rest.split(";"))):
            if part == "no crash":
                continue
            window = _PAST_WINDOW.fullmatch(part)
            if window is not None:
                past_window = window[1]
                continue
            match = _CRASH.fullmatch(part)
            if match is None:
                raise ValueError(f"not a crash: {part!r} (e.g. 'attempt 1 raises at X:y')")
            effect: Kind = next((e for e, v in _VERBS.items() if v == match[2]), "conflict")
            times = int(match[3] or 1)
            crashes.append(Crash(int(match[1]), match[4], int(match[5] or 1), effect, times))
        way: Recovery = "client" if recovery.strip() == "client" else "completer"
        return cls(way, tuple(crashes), past_window)


@dataclass
class Failure:
    """One schedule that broke an invariant, and all a person needs to act on it."""

    schedule: Schedule
    invariant: str
    detail: str
    story: list[str]
    held: list[str]
    hints: list[str]

    def report(self) -> str:
        lines = [f"smallest failing schedule: {self.schedule}"]
        lines += [f"  {line}" for line in self.story]
        lines.append(f"broken invariant: {self.invariant}")
        lines += [f"  {line}" for line in self.detail.splitlines()]
        lines += [f"why: {hint}" for hint in self.hints]
        lines += ["what the database held:"] + [f"  {line}" for line in self.held]
        lines.append(f'reproduce: explore(..., schedule="{self.schedule}")')
        return "\n".join(lines)


@dataclass
class Exploration:
    """What :func:`explore` found: ``ok``, the schedules run, and the failures, smallest
    schedule first."""

    operation: str
    depth: int
    schedules: int = 0
    seconds: float = 0.0
    by_depth: Counter[int] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    past_window: dict[str, str] = field(default_factory=dict)
    """Each schedule whose recovery came after a step's dedupe window had passed (and that
    broke no invariant) → what became of its key: ``finished: its reconcile hook found
    the call``, ``finished: called anew, its reconcile hook having found nothing``, or
    ``needs reconciliation`` (the step declares no hook: an operator's to resolve)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def reached(self) -> int:
        """The most crashes in a schedule run: ``depth``, unless the search ended with the
        depth that found a failure (or ran one schedule)."""
        return max(self.by_depth, default=0)

    @property
    def held(self) -> int:
        """Schedules that left their key waiting for an operator's reconciliation."""
        return sum(outcome == _HELD for outcome in self.past_window.values())

    def windows(self) -> str | None:
        """What recovery past the providers' dedupe windows came to, in a line or two;
        ``None`` when no step declares a window."""
        if not self.past_window:
            return None
        outcomes = Counter(self.past_window.values())
        counted = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        line = f"past a provider's dedupe window: {len(self.past_window)} schedules ({counted})"
        if not self.held:
            return line
        return (
            f"{line}\n{self.held} left the key in the state needs-reconciliation, as expected "
            "of a step without a reconcile hook: in production such a key waits for an "
            "operator, who finds out what the step's last call did and runs `recoverypoint "
            "keys reconcile ID --found JSON` or `--not-found` (docs/how-to/operating.md)"
        )

    def summary(self) -> str:
        if self.ok:
            return (
                f"{self.operation}: every invariant held in {self.schedules} schedules "
                f"(depth {self.reached}) in {self.seconds:.1f}s"
            )
        return (
            f"{self.operation}: {len(self.failures)} of {self.schedules} schedules broke an "
            f"invariant (depth {self.reached}, {self.seconds:.1f}s)"
        )

    def report(self) -> str:
        """The summary and, on failure, the smallest failing schedule in full."""
        windows = [line] if (line := self.windows()) is not None else []
        if self.ok:
            return "\n".join([self.summary(), *windows])
        others = sorted({f.invariant for f in self.failures[1:]} - {self.failures[0].invariant})
        tail = [f"also broken in schedules as small: {', '.join(others)}"] if others else []
        return "\n".join([self.summary(), self.failures[0].report(), *tail, *windows])


@dataclass
class _Run:
    """What one schedule did, as it happened."""

    schedule: Schedule
    attempt: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    trace: list[Crash] = field(default_factory=list)  # every boundary reached
    story: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # what each client call got
    calls: Counter[str] = field(default_factory=Counter)  # foreign step → calls
    returned: Counter[str] = field(default_factory=Counter)  # foreign step → calls that returned
    downstream: dict[str, list[str]] = field(default_factory=dict)  # step → keys asked for
    deliveries: Counter[str] = field(default_factory=Counter)  # job_key → deliveries
    window_passed: bool = False  # the schedule's past_window has passed
    reconciled: Counter[str] = field(default_factory=Counter)  # step → hook calls past it
    renewed: set[str] = field(default_factory=set)  # steps whose hook found nothing past it
    blind: Counter[str] = field(default_factory=Counter)  # step → calls past it, not renewed
    raised: list[tuple[int, str, str]] = field(default_factory=list)  # attempt, phase, error
    # A failover's: the tables the lost commit wrote, as they were before it (sent by the
    # attempt's process, put back by explore's).
    lost: _failover.Rows | None = None
    pipe: int | None = None  # in an attempt's process: where what it saw goes before it ends

    def send(self, dies: bool) -> None:
        """What this attempt's process saw, a line to explore's process, once it ends."""
        if self.pipe is not None:
            seen = {name: getattr(self, name) for name in _SEEN}
            line = json.dumps({**seen, "dies": dies}, default=_plain).encode() + b"\n"
            while line:
                line = line[os.write(self.pipe, line) :]
            self.pipe = None

    def absorb(self, record: bytes) -> bool:
        """Add what an attempt's process saw (its :meth:`send`); whether it died."""
        seen = json.loads(record)
        for name in ("calls", "returned", "reconciled", "blind", "deliveries"):
            getattr(self, name).update(seen[name])
        for step, keys in seen["downstream"].items():
            self.downstream.setdefault(step, []).extend(keys)
        self.renewed.update(seen["renewed"])
        self.trace += [Crash(a, p, n) for a, p, n in seen["trace"]]
        self.story += seen["story"]
        self.answers += seen["answers"]
        self.raised += [(a, p, e) for a, p, e in seen["raised"]]
        self.lost = seen["lost"]
        return bool(seen["dies"])

    def decide(self, point: str) -> Kind | None:
        """The fault registry's watcher: record the boundary, crash where scheduled."""
        self.hits[point] += 1
        nth = self.hits[point]
        self.trace.append(Crash(self.attempt, point, nth))
        crash = self.schedule.crash_in(self.attempt)
        if crash is None or not crash.fires(point, nth):
            return None
        if crash.effect == "conflict":
            self.story.append(
                f"{self.attempt}.           serialization failure at {point}: rolled back, "
                "the phase runs again"
            )
        if crash.effect == "lost_answer":
            self.story.append(
                f"{self.attempt}.           lost the answer at {point}: committed, the caller "
                "sees the connection drop"
            )
        if crash.effect == "exit":
            self.send(dies=True)  # its last word: the process dies next
        return crash.effect


# What an attempt's process sees that explore's needs: sent back when the attempt ends.
_SEEN = (
    "trace",
    "story",
    "answers",
    "calls",
    "returned",
    "downstream",
    "deliveries",
    "reconciled",
    "renewed",
    "blind",
    "raised",
    "lost",
)


def _plain(value: object) -> object:
    if isinstance(value, Crash):
        return [value.attempt, value.point, value.nth]
    if isinstance(value, set):
        return sorted(value)
    raise TypeError(type(value).__name__)


@dataclass(frozen=True)
class _Process:
    """A process that runs attempts on explore's orders, forked from explore's before it
    ran any: explore writes each attempt's orders, a line, to the pipe ``orders`` and reads
    what the attempt saw, a line, from ``seen``; closing ``orders`` ends the process."""

    pid: int
    orders: int
    seen: BinaryIO


class _Recorder:
    """The job backend during exploration: counts each delivery, then delivers."""

    def __init__(self, backend: JobBackend, run: Callable[[], _Run]) -> None:
        self.backend = backend
        self.run = run

    def publish(self, job: Job) -> None:
        self.run().deliveries[job.job_key] += 1
        self.backend.publish(job)


@dataclass
class Subject:
    """An operation ready to explore: what ``recoverypoint explore module:name`` gets from
    ``name(database_url)``, a function that builds it on the throwaway database it is
    given (migrated already: create your own tables in it). Its fields are
    :func:`explore`'s arguments (``request`` for a single-step endpoint, instead of
    ``params``)."""

    engine: Engine
    operation: Operation[Any] | Callable[..., Any]
    params: Any = None
    scope: str = ""
    check: Check | Sequence[Check] = ()
    tables: Sequence[str] = ()
    setup: Callable[[sa.Connection], None] | None = None
    dispose: Sequence[sa.Engine] = ()
    request: Callable[[], Any] | None = None

    def explore(self, **options: Any) -> Exploration:
        """:func:`explore` with this subject; ``options`` are its keyword arguments."""
        return explore(
            self.engine,
            self.operation,
            self.params,
            scope=self.scope,
            check=self.check,
            tables=self.tables,
            setup=self.setup,
            dispose=self.dispose,
            request=self.request,
            **options,
        )


def explore(
    engine: Engine,
    operation: Operation[Any] | Callable[..., Any],
    params: Any = None,
    *,
    scope: str = "",
    check: Check | Sequence[Check] = (),
    tables: Sequence[str] = (),
    setup: Callable[[sa.Connection], None] | None = None,
    dispose: Sequence[sa.Engine] = (),
    request: Callable[[], Any] | None = None,
    depth: int = 2,
    effects: Sequence[Kind] = KINDS,
    recoveries: Sequence[Recovery] = ("client", "completer"),
    schedule: str | Schedule | None = None,
    max_schedules: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> Exploration:
    """Run ``operation`` (registered with ``engine``) with ``params`` once per crash
    schedule, up to ``depth`` crashes each, and check every invariant after each.
    ``operation`` may be an ``@idempotent`` function, called with ``params`` as its
    keyword arguments; only a call again resumes one, so its client alone recovers it.

    ``request()``, instead of ``params``, makes the request itself, always with the same
    idempotency key, and returns what its client got (compared across replays: return the
    status and body, not the replay's headers); raise where the client would retry (a
    5xx). A single-step endpoint needs it (its view runs only inside a request: call it
    through your framework's test client); its client alone recovers it.

    ``check(connection)`` raises (an ``assert`` will do) when your invariant is broken;
    pass several as a list. ``tables`` are yours to empty between schedules (in this
    order, a table before those it refers to; their identities restart), and
    ``setup(connection)`` puts back what a schedule needs. Exploration deletes every key
    and staged job in ``engine``'s database: give it a database of its own
    (:func:`recoverypoint.testing.temporary_database`).

    Attempts run in forked processes (a crash with ``effect="exit"`` kills one); list in
    ``dispose`` your own SQLAlchemy engines so that no pooled connection crosses a fork.
    ``schedule`` runs one schedule only (a report's ``reproduce`` line). ``progress(done,
    known)`` is called after each schedule; ``known`` grows as deeper schedules appear.
    """
    explorer = _Explorer(
        engine,
        operation,
        params,
        scope,
        [check] if callable(check) else list(check),
        tables,
        setup,
        dispose,
        request,
    )
    found = Exploration(explorer.operation.name, depth)
    if not explorer.resumable:
        recoveries = ("client",)
    started = time.perf_counter()
    with explorer.instrumented():
        if schedule is not None:
            planned = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
            explorer.run(planned, found)
        else:
            explorer.search(found, depth, effects, recoveries, max_schedules, seed, progress)
    found.seconds = time.perf_counter() - started
    return found


class _Explorer:
    def __init__(
        self,
        engine: Engine,
        operation: Operation[Any] | Callable[..., Any],
        params: Any,
        scope: str,
        checks: list[Check],
        tables: Sequence[str],
        setup: Callable[[sa.Connection], None] | None,
        dispose: Sequence[sa.Engine],
        request: Callable[[], Any] | None,
    ) -> None:
        self.engine = engine
        self.params = params
        self.scope = scope
        decorated = getattr(operation, "operation", None)  # an @idempotent function's
        self.single_step = isinstance(operation, Operation) and is_single_step(operation)
        self.operation: Operation[Any]
        self.request: Callable[[], Any]
        if request is not None:
            if not isinstance(operation, Operation):
                raise TypeError(f"explore with request= takes an Operation, not {operation!r}")
            self.operation = operation
            self.request = request
            # A single-step endpoint's view runs only inside a request: its client's.
            self.resumable = not self.single_step
        elif self.single_step:
            raise TypeError(
                "a single-step endpoint's view runs only inside a request: pass request=, "
                "a function that sends it through your framework's test client"
            )
        elif isinstance(operation, Operation):
            self.operation = operation
            self.request = self._run_operation
            self.resumable = True
            operation.dump_params(params)  # bad params: an error now, not in every schedule
        elif isinstance(decorated, Operation):
            self.operation = decorated
            self.request = functools.partial(operation, **params)
            # Its arguments live in its caller alone: only a call again can resume it.
            self.resumable = False
        else:
            raise TypeError(
                f"explore takes an Operation or an @idempotent function, not {operation!r}"
            )
        name, version = self.operation.name, self.operation.version
        if engine.operation(name, version) is not self.operation:
            raise ValueError(f"register {name!r} with the engine before exploring it")
        self.checks = checks
        # The foreign steps whose provider forgets a downstream key after a window.
        self.windows = {p.point: p.dedupe_window for p in self.operation.phases if p.dedupe_window}
        self.hooked = {p.point for p in self.operation.phases if p.reconcile is not None}
        self.tables = [*tables, *_OWN_TABLES]  # yours first: they may refer to the keys
        self.reset: str | None = None
        self.conn: sa.Connection
        self.parents: sa.Connection | None = None  # in a forked process: explore's connection
        self.orders: BinaryIO  # in a forked process: where its attempts' orders come from
        # In a forked process: the connections the engine's pool made there, to end.
        self.connections: list[psycopg.Connection[Any]] = []
        self.spare: _Process | None = None  # the next process, forked ahead, ready
        self.running: _Process | None = None  # the last attempt's, if it did not crash
        self.standby: _failover.Rows = {}  # in an attempt's process: see _read_standby
        self.waiting: _Process | None = None  # an attempt's whose key is being taken over
        self.ending: list[int] = []  # processes told to end, not yet reaped
        self.setup = setup
        self.dispose = [engine.db, *dispose]
        self.current = _Run(Schedule())
        # Only while a failing schedule is run again to tell what process memory did: an
        # attempt that does not die runs in the process of the attempts before it.
        self.one_process = False

    # -- the search ----------------------------------------------------------------------

    def search(
        self,
        found: Exploration,
        depth: int,
        effects: Sequence[Kind],
        recoveries: Sequence[Recovery],
        max_schedules: int | None,
        seed: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        """Breadth first: every schedule of one crash before any of two, so the first
        failure is a smallest one; the search ends with the depth that found one."""
        level = [Schedule(recoveries[0])]
        known = 1
        order = random.Random(seed)
        while level and not found.failures:
            following: list[Schedule] = []
            for planned in level:
                if max_schedules is not None and found.schedules >= max_schedules:
                    return
                run = self.run(planned, found)
                if progress is not None:
                    progress(found.schedules, known)
                if planned.depth < depth:
                    following += _extensions(planned, run, effects, recoveries, self.windows)
            if max_schedules is not None:
                order.shuffle(following)
            known += len(following)
            level = following

    def run(self, planned: Schedule, found: Exploration) -> _Run:
        step = planned.past_window
        if step is not None and step not in self.windows:
            raise ValueError(
                f"{step!r} is not a foreign step of {self.operation.name!r} that declares a "
                f"dedupe_window (those that do: {', '.join(self.windows) or 'none'})"
            )
        for crash in planned.crashes:
            if crash.effect == "failover" and not crash.point.startswith("after_commit:"):
                raise ValueError(
                    f"{crash}: a failover loses a commit, so it comes after one: write "
                    "it at after_commit:<phase>"
                )
        run = self._play(planned)
        found.schedules += 1
        found.by_depth[planned.depth] += 1
        broken = self._broken(run)
        if broken is not None:
            invariant, detail = broken
            held = self._held()  # before the schedule is run again, in one process
            hints = self._hints(run, invariant)
            memory = self._memory(run)
            found.failures.append(
                Failure(planned, invariant, detail, run.story, held, [*memory, *hints])
            )
        elif step is not None:
            found.past_window[str(planned)] = (
                _HELD
                if self._state().held
                else "finished: called anew, its reconcile hook having found nothing"
                if step in run.renewed
                else "finished: its reconcile hook found the call"
                if run.reconciled[step]
                else "finished"
            )
        return run

    def _play(self, planned: Schedule) -> _Run:
        """Run ``planned`` from empty tables: each attempt, until the key needs none."""
        run = self.current = _Run(planned)
        self._reset()
        with faults.watching(self._watcher(run)):
            while (actor := self._next_actor(run)) is not None:
                run.attempt += 1
                run.hits.clear()
                crash = planned.crash_in(run.attempt)
                # A takeover runs beside the attempt it takes over from: in processes apart.
                apart = crash is not None and crash.effect in (*KILLING, "lease_lost")
                if self.one_process and not apart:
                    self._attempt(actor, run)
                else:
                    self._apart(actor, run)
                if planned.past_window is not None and run.attempt == 1:
                    self._pass_window(planned.past_window, run)
        self._end()  # it ran this schedule's operation: not the next one's
        return run

    def _pass_window(self, step: str, run: _Run) -> None:
        """Time moves past the provider's dedupe window of ``step``: every moment
        recoverypoint stores moves back (the provider is yours to make forget)."""
        window = self.windows[step]
        Clock(self.engine.db).advance(window + _PAST)
        run.window_passed = True
        run.story.append(f"   time passes: past the dedupe window of {step} ({window})")

    # -- one attempt -----------------------------------------------------------------------

    def _next_actor(self, run: _Run) -> str | None:
        if run.attempt > _RECOVERY_ATTEMPTS + run.schedule.depth:
            return None
        key = self._state()
        if not key.stored:
            return "client"  # nothing stored (the first phase rolled back): it comes back
        if key.held:
            return None  # neither a client nor a worker takes it: an operator's to resolve
        if key.response_status is None:
            return run.schedule.recovery
        if self.engine.jobs is not None and key.staged:
            return "enqueuer"
        return None

    def _attempt(self, actor: str, run: _Run) -> None:
        label = f"{run.attempt}. {actor:<9}"
        try:
            if actor == "client":
                got = self.request()
                answer = _answer(got)
                run.answers.append(answer)
                run.story.append(
                    f"{label} {'answered' if isinstance(got, Outcome) else 'got'} {answer}"
                )
            elif actor == "completer":
                done = Completer(self.engine, min_age=0).run_once()
                run.story.append(f"{label} finished {done.finished}, failed {done.failed}")
            else:
                published = Enqueuer(self.engine).run_once()
                run.story.append(f"{label} published {published.published}")
        except InjectedFault as exc:
            run.story.append(f"{label} raised at {exc}")
        except Exception as exc:  # the operation's own failure: the next attempt retries
            run.story.append(f"{label} failed: {type(exc).__name__}: {exc}"[:300])

    def _apart(self, actor: str, run: _Run) -> None:
        """Run the attempt in a process forked from explore's (which never runs the
        operation): the one that ran the attempt before, unless that one crashed, else a
        new one, so that a recovery finds nothing a crashed attempt kept in memory. At a
        scheduled ``exit`` crash the process dies as a SIGKILL would leave it (no rollback
        sent, no lease released), having sent what it saw first."""
        process = self.running = self.running or self.spare or self._fork()
        self.spare = None if self.spare is process else self.spare
        orders = {
            "actor": actor,
            "schedule": asdict(run.schedule),
            "attempt": run.attempt,
            "window_passed": run.window_passed,
            "renewed": sorted(run.renewed),
        }
        os.write(process.orders, json.dumps(orders).encode() + b"\n")
        self.spare = self.spare or self._fork()  # made ready while the attempt runs
        line = process.seen.readline()
        while line and (point := json.loads(line).get("takeover")) is not None:
            self._take_over(process, point, run)
            line = process.seen.readline()
        if line and not run.absorb(line):
            if run.schedule.crash_in(run.attempt) is not None:
                self._end()  # it raised at its crash: the recovery runs in another process
            return
        self.running = None
        os.close(process.orders)
        process.seen.close()
        code = os.waitstatus_to_exitcode(os.waitpid(process.pid, 0)[1])
        self._await_rollback()
        crash = run.schedule.crash_in(run.attempt)
        if run.lost is not None:
            self._put_back(run, actor)
        elif line and crash is not None:
            run.story.append(f"{run.attempt}. {actor:<9} died at {crash.point}")
        else:
            run.story.append(f"{run.attempt}. {actor:<9} ended its process (exit status {code})")

    def _take_over(self, process: _Process, point: str, run: _Run) -> None:
        """The attempt in ``process`` waits at ``point``, its lease run out: the schedule's
        recovery takes the key over and runs in another process, then that attempt goes on
        (to record its step's result, which its fence must refuse)."""
        first = run.attempt
        run.attempt += 1
        self._state()  # the lease moved back past its lock_timeout: the key may be taken
        run.story.append(
            f"{first}.           its lease ran out while its step ran, at {point}: "
            f"attempt {run.attempt} takes the key over"
        )
        self.running, self.waiting = None, process
        self._apart(run.schedule.recovery, run)
        self._end()  # the taking over's process: the first attempt's goes on
        self.running, self.waiting = process, None
        os.write(process.orders, b"{}\n")

    def _fork(self) -> _Process:
        """A process for the attempts to come, the engine's connection opened ahead (a
        connection costs more than a fork), running each attempt it is told to until told
        to end. Your engines connect when an attempt first uses them: many attempts end,
        at their crash, before the step that would (half of Rocket Rides' processes, whose
        connections to depth two went from 2,239 to 1,762)."""
        self._reap()
        orders, orders_w = os.pipe()
        seen_r, seen = os.pipe()
        heartbeat.quiesce()  # a renewer thread, still idling: not forked
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns to report coverage
            try:
                os.close(orders_w)
                os.close(seen_r)
                self._detach()
                if not isinstance(self.engine.db.pool, NullPool):
                    self.engine.db.connect().close()  # into its pool, for the attempt
                with os.fdopen(orders, "rb") as pipe:
                    self.orders = pipe
                    for line in pipe:
                        self._ordered(json.loads(line), seen)
            finally:
                os._exit(0)
        os.close(orders)
        os.close(seen)
        return _Process(pid, orders_w, os.fdopen(seen_r, "rb"))

    def _ordered(self, orders: dict[str, Any], seen: int) -> None:
        """In an attempts' process: the attempt its orders name, what it saw sent back."""
        planned = orders["schedule"]
        crashes = tuple(Crash(**crash) for crash in planned["crashes"])
        schedule = Schedule(planned["recovery"], crashes, planned["past_window"])
        run = self.current = _Run(schedule, orders["attempt"], pipe=seen)
        run.window_passed = orders["window_passed"]
        run.renewed = set(orders["renewed"])
        with faults.watching(self._watcher(run)):
            self._attempt(orders["actor"], run)
        if run.lost is not None:  # no COMMIT after the lost one: the primary fails now
            self._fail_over(run, "as the attempt ends")
            os._exit(FAULT_EXIT_STATUS)
        run.send(dies=False)

    def _end(self, *processes: _Process | None) -> None:
        """Tell the running process (or ``processes``) to end; it is reaped later (an exit
        takes a while)."""
        for process in processes or (self.running,):
            if process is not None:
                os.close(process.orders)
                process.seen.close()
                self.ending.append(process.pid)
        self.running = None

    def _reap(self) -> None:
        for pid in self.ending:
            os.waitpid(pid, 0)
        self.ending.clear()

    def _detach(self) -> None:
        """In a forked process: connections of its own, once it needs them. The parent's
        stay open, untouched (closing one would end the parent's session too); the other
        processes' pipes are closed, so that each ends when explore closes its own."""
        for process in (self.spare, self.running, self.waiting):
            if process is not None:
                os.close(process.orders)
                process.seen.close()
        self.spare = self.running = self.waiting = None
        self.ending.clear()  # explore's to reap
        for db in self.dispose:
            db.dispose(close=False)
        sa.event.listen(self.engine.db.pool, "connect", self._made)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - a fault's "exiting" line is ours to tell
        self.parents = self.conn  # kept from the collector, which would roll it back

    def _made(self, connection: psycopg.Connection[Any], _: object) -> None:
        self.connections.append(connection)

    def _watcher(self, run: _Run) -> Callable[[str], Effect | None]:
        """What decides at every boundary of ``run``: its schedule, where a ``disconnect``
        is brought about here, the attempt going on."""

        def decide(point: str) -> Effect | None:
            kind = run.decide(point)
            if run.lost is not None and point.startswith("before_commit:"):
                return self._fail_over(run, f"at {point}")
            if kind == "disconnect":
                self._disconnect(run, point)
            elif kind == "lease_lost":
                self._lose_lease(run, point)
            elif kind == "failover":
                self._not_replicated(run, point)
            else:
                self._read_standby(run, point)
                return kind
            return None

        return decide

    @contextmanager
    def _aside(self) -> Iterator[sa.Connection]:
        """In an attempt's process: a connection of another pool than the engine's, in
        autocommit (each statement a transaction, with a fresh snapshot)."""
        apart = sa.create_engine(
            self.engine.db.url, poolclass=NullPool, isolation_level="AUTOCOMMIT"
        )
        try:
            with apart.connect() as conn:
                yield conn
        finally:
            apart.dispose()

    def _disconnect(self, run: _Run, point: str) -> None:
        """End the backends of the engine's pooled connections in this process, from a
        connection of another pool, as a failover or pg_terminate_backend would."""
        pids = [c.info.backend_pid for c in self.connections if not c.closed]
        self.connections.clear()
        with self._aside() as conn:
            ended = conn.scalar(_TERMINATE, {"pids": pids})
            deadline = time.monotonic() + _GONE_WITHIN
            while conn.scalar(_LEFT, {"pids": pids}) and time.monotonic() < deadline:
                time.sleep(0.01)
        run.story.append(
            f"{run.attempt}.           its connections ended at {point}: {ended} backend(s) "
            "terminated, the step runs on"
        )

    def _lose_lease(self, run: _Run, point: str) -> None:
        """In an attempt's process, its step returned (its renewals stopped): the lease
        runs out, as a step slower than lock_timeout whose renewals did not get through
        would leave it (explore's process moves it back, as before every attempt), and
        another attempt takes the key over while this one waits here, its step's result
        not yet recorded."""
        if run.pipe is not None:
            os.write(run.pipe, json.dumps({"takeover": point}).encode() + b"\n")
            self.orders.readline()  # the taking over ended

    # -- a failover that loses a commit --------------------------------------------------
    #
    # A standby that lags is promoted: the primary's last commits never reached it. Which
    # tables a lost commit wrote is read off the database, not asked of the caller: those
    # whose rows differ just before the commit and just after it (nothing else writes
    # meanwhile), kept as they were before. A provider whose rows live in this database (a
    # fake one, its table in ``tables``) is written by its step, outside any phase's
    # transaction: it keeps what the step did, as a real provider would. Sequences are not
    # put back: a promoted standby may hand out ids again or not, so an id that a lost
    # phase got (a serial column's, the key row's own) is not the one its retry gets.

    def _read_standby(self, run: _Run, point: str) -> None:
        """At the point before the commit a failover is to lose (an atomic phase's, or a
        step's result committed alone), the tables as the standby will have them."""
        crash = run.schedule.crash_in(run.attempt)
        if crash is None or crash.effect != "failover":
            return
        boundary, _, name = point.partition(":")
        if boundary in ("before_commit", "after_foreign") and crash.point == f"after_commit:{name}":
            with self._aside() as conn:
                self.standby = _failover.read(_driver(conn), self.tables)

    def _not_replicated(self, run: _Run, point: str) -> None:
        """The commit went through on the primary, not yet on its standby: the attempt goes
        on until its next COMMIT, where the primary is found gone."""
        with self._aside() as conn:
            committed = _failover.read(_driver(conn), self.tables)
        run.lost = _failover.written(self.standby, committed)
        run.story.append(
            f"{run.attempt}.           committed at {point}, not yet on the standby that "
            "is about to be promoted; the attempt goes on"
        )

    def _fail_over(self, run: _Run, where: str) -> Effect:
        """The primary is gone: the attempt's process dies with it (its last word sent)."""
        run.story.append(
            f"{run.attempt}.           the primary fails {where}: its standby is promoted"
        )
        run.send(dies=True)
        return "exit"

    def _put_back(self, run: _Run, actor: str) -> None:
        """In explore's process, the attempt's process gone: the database as the promoted
        standby has it. Answers the attempt gave are lost with the commits they came of."""
        lost = run.lost or {}
        try:
            _failover.put_back(_driver(self.conn), lost, self.tables)
        except psycopg.errors.ForeignKeyViolation as exc:
            raise ValueError(
                f"a failover could not put {', '.join(lost)} back as they were before the "
                f"lost commit: {exc.diag.message_primary}. Make that foreign key DEFERRABLE, "
                "explore as a role that may set session_replication_role (a superuser), or "
                "leave the failover out of effects="
            ) from None
        run.story.append(
            f"{run.attempt}. {actor:<9} died with the primary: {', '.join(lost)} back as "
            "before the lost commit, the providers' side as the attempt left it"
        )
        if run.answers:  # not a replay's to match: a lossy failover may lose an answer
            run.story.append(f"   lost with it: the answer {run.answers[-1]}")
            run.answers.clear()
        run.lost = None

    # -- process memory --------------------------------------------------------------------

    def _memory(self, run: _Run) -> list[str]:
        """The hint, when ``run`` recovered from a crash and broke, that the same schedule
        holds when the process of the crashed attempt recovers the key (as explore did
        before each attempt had a process of its own): what broke was kept in memory."""
        raised = [c for c in run.schedule.crashes if c.effect == "raise"]
        if not raised or run.attempt <= raised[0].attempt or not self._held_in_one_process(run):
            return []
        failed = next((r for r in run.raised if r[0] > raised[0].attempt), None)
        before = [c for c in raised if failed is None or c.attempt < failed[0]]
        crash = f"attempt {before[-1].attempt} raised at {before[-1].point}"
        lost = (
            "Process memory (a module-level variable, a cache, an object's attribute) is not "
            "kept across a crash, and in production another process recovers the key (the "
            "client's retry reaches another server, the completer is a process apart): use "
            "tx.state to hand a value from one phase or step to the next (a foreign step "
            "returns it), which is stored with the recovery point."
        )
        if failed is None:
            return [
                f"after {crash}, the schedule broke when another process recovered the key, "
                "and held when the crashed attempt's own process did: the operation kept "
                f"something in process memory between attempts. {lost}"
            ]
        attempt, point, error = failed
        return [
            f"a value read by `{point}` was not in `tx.state` after {crash}: recovered by "
            f"another process (attempt {attempt}), `{point}` raised {error}; recovered by the "
            f"crashed attempt's own process, the schedule held. {lost}"
        ]

    def _held_in_one_process(self, run: _Run) -> bool:
        """Whether ``run``'s schedule holds when an attempt that does not die runs in the
        process of the attempts before it: played in a process of its own, forked, so that
        explore's process never runs the operation."""
        heartbeat.quiesce()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns to report coverage
            broken = True
            try:
                self._detach()
                self.conn = self.engine.db.connect().execution_options(isolation_level="AUTOCOMMIT")
                self.one_process = True
                broken = self._broken(self._play(run.schedule)) is not None
            finally:
                os._exit(1 if broken else 0)
        _, status = os.waitpid(pid, 0)
        self._await_rollback()
        self.current = run
        return os.waitstatus_to_exitcode(status) == 0

    # -- the invariants --------------------------------------------------------------------

    def _broken(self, run: _Run) -> tuple[str, str] | None:
        blind = next(iter(run.blind.items()), None)
        if blind is not None:
            step, calls = blind
            hook = (
                "its reconcile hook found nothing"
                if step in self.hooked
                else "an operator reconciled the key (it declares no reconcile hook, so the "
                "key should have waited in the state needs-reconciliation)"
            )
            return "past its provider's dedupe window, a step is not called blindly again", (
                f"foreign step {step!r} was called {calls} time(s) after its provider's "
                f"dedupe window ({self.windows[step]}) had passed, before {hook}; a provider "
                "that forgot the downstream key would act again. recoverypoint's engine "
                "judges the window: is this engine older than the operation's declaration?"
            )
        key = self._state()
        if key.held and run.schedule.past_window not in (None, *self.hooked):
            # Expected of a step without a hook: held for an operator, answering 423 (so
            # no replay to compare), its effects as the crash left them (so no check).
            return None
        if not key.stored or key.response_status is None or key.abandoned:
            where = f"stopped at {key.recovery_point}" if key.stored else "was never stored"
            error = f"; last error: {key.last_error}" if key.stored else ""
            return "the key finishes", f"the key {where}{error}"
        if key.leased:
            return "no lease is left", "the finished key's lease is still held"
        run.answers += [_answer(self.request()) for _ in range(2)]  # two replays
        first = run.answers[0]
        for answer in run.answers[1:]:
            if answer != first:
                return "the answer is stable across replays", (
                    f"a client was told {first}, then {answer}"
                )
        if self.engine.jobs is not None:
            if key.staged:
                return "each staged job is published", f"{key.staged} job(s) never published"
            consumed = set(self.conn.scalars(_CONSUMED, {"keys": list(run.deliveries)}))
            for job_key, times in run.deliveries.items():
                # Delivered once, any consumer is right; delivered again, only one that
                # dedupes on the job key is.
                if times > 1 and job_key not in consumed:
                    return "each staged job is consumed once, through consume_once", (
                        f"job {job_key} was delivered {times} times and its consumer never "
                        "called consume_once(connection, consumer, job.job_key)"
                    )
        for check in self.checks:
            try:
                with self.engine.db.connect() as conn:  # not ours: a check may end a transaction
                    check(conn)
            except Exception as exc:
                name = getattr(check, "__name__", "check")
                return f"your check {name}", f"{type(exc).__name__}: {exc}"
        return None

    def _hints(self, run: _Run, invariant: str) -> list[str]:
        """Where the guarantee ended, read from what the foreign steps and jobs did."""
        hints = []
        for step, calls in run.calls.items():
            if calls < 2:
                continue
            keys = run.downstream.get(step, [])
            if self.single_step:
                hints.append(
                    f"the endpoint ran {calls} times: a crash after it answered and before "
                    "its answer was stored has its client's retry run it again. What it does "
                    "must be done once whatever the number of runs: pass the request's "
                    "idempotency key on to the provider, or make it a phased operation."
                )
            elif not keys:
                hints.append(
                    f"foreign step {step!r} ran {calls} times and never asked for "
                    "step.downstream_key(): the provider cannot tell its retry from a new "
                    "request. Pass the key as the provider's idempotency key."
                )
            elif len(set(keys)) == 1 and run.returned[step] > 1 and invariant.startswith("your"):
                # Returned more than once, the provider answering each time, and what it
                # did is what your check found wrong (not a key that failed to finish).
                hints.append(
                    f"foreign step {step!r} ran {calls} times with the same downstream key "
                    f"{keys[0]!r}. If the provider acted twice, the provider is where the "
                    "guarantee ends: it does not dedupe on that key (see its idempotency "
                    "documentation), or the key does not reach it."
                )
        for crash in run.schedule.crashes:
            if crash.effect == "conflict":
                point = crash.point.partition(":")[2]
                hints.append(
                    f"attempt {crash.attempt} ran phase {point!r} {crash.times + 1} times: "
                    f"{crash.times} serialization failure(s) rolled its transaction back, and "
                    "the engine ran it again each time, with the same params. Only what it "
                    "does in its transaction is rolled back: it must not change its params "
                    "or anything kept between runs, nor call anything outside the database."
                )
            if crash.effect == "lost_answer":
                hints.append(
                    f"attempt {crash.attempt}'s COMMIT at {crash.point} went through and its "
                    "caller saw the connection drop (DatabaseUnavailable, a 503): an outage "
                    "does not say that nothing was written. Code around the engine's call must "
                    "not take it for a failure (undo, notify, retry under another key): a retry "
                    "with the same key finds the recovery point advanced and goes on from there."
                )
            if crash.effect == "disconnect":
                hints.append(
                    f"the engine's connections were ended at {crash.point} of attempt "
                    f"{crash.attempt} (as a failover or pg_terminate_backend does), and what "
                    "ran after it met a dead connection. The engine records the step's result "
                    "on a new connection, and the retry goes on after it; code that keeps a "
                    "connection, a cursor or session state (SET, a temporary table, a session "
                    "advisory lock) from one phase or step to the next loses it there."
                )
            if crash.effect == "lease_lost":
                hints.append(
                    f"attempt {crash.attempt}'s lease ran out while its step ran (to "
                    f"{crash.point}) and attempt {crash.attempt + 1} took the key over and ran "
                    "the step again: the provider is asked twice with the same downstream key "
                    "and must dedupe on it, and the first attempt's recording of its step's "
                    "result must be refused (LockLost). Make lock_timeout longer than the "
                    "step's slowest call: renewals keep a live holder's lease meanwhile."
                )
            if crash.effect == "failover":
                hints.append(
                    f"attempt {crash.attempt}'s commit at {crash.point}, and what it wrote "
                    "after it, was lost to a failover (a standby that lagged was promoted), "
                    "while what its steps did at their providers stayed: the retry ran the "
                    "lost phases and steps again. A step must hand its provider "
                    "step.downstream_key(), derived from the scope, operation, key and the "
                    "database's namespace, the same after a failover; not a key of its own, "
                    "nor one made of what a lost phase wrote (a row's id, the key row's): "
                    "those change. A job staged again carries the same job_key. An answer "
                    "given before the failover is lost with it (only a synchronous standby "
                    "keeps it): a client's retry may get another."
                )
        for job_key, times in run.deliveries.items():
            if times > 1:
                hints.append(
                    f"job {job_key} was delivered {times} times (delivery is at least once): "
                    "its consumer must run its work under consume_once(conn, name, job.job_key)."
                )
        return hints

    def _held(self) -> list[str]:
        held = []
        with self.engine.db.connect() as conn:
            for table in self.tables:
                columns = _SHOWN.get(table, "*")
                query = sa.text(f"SELECT {columns} FROM {table}")
                rows = conn.execute(query).mappings().all()
                held.append(f"{table}: {len(rows)} row(s)")
                held += [f"  {_json(dict(r))}"[:300] for r in rows[:_ROWS_SHOWN]]
        return held

    # -- the database ----------------------------------------------------------------------

    def _reset(self) -> None:
        """Empty the tables and restart their identities: on tables this small, DELETE
        takes a fraction of TRUNCATE's time (which writes new files for each)."""
        conn = self.conn
        if self.reset is None:
            sequences = conn.scalars(_SEQUENCES, {"tables": self.tables})
            # One round trip: the table names are the caller's, the sequences PostgreSQL's.
            self.reset = "; ".join(
                [f"DELETE FROM {table}" for table in self.tables]
                + [
                    f"SELECT setval('{name.replace(chr(39), chr(39) * 2)}', 1, false)"
                    for name in sequences
                ]
            )
        conn.exec_driver_sql(self.reset)
        if self.setup is not None:
            self.setup(conn)

    def _await_rollback(self) -> None:
        """Until PostgreSQL has seen the dead process's connection drop and rolled its
        transaction back: its row locks would otherwise make the next attempt's SKIP
        LOCKED claims pass over the rows, as no real recovery that far apart would."""
        for _ in range(_ROLLBACK_POLLS):
            if not self.conn.scalar(_OPEN_TRANSACTIONS):
                return
            time.sleep(0.001)

    def _state(self) -> sa.Row[Any]:
        # The operation's only key: each schedule begins with the tables empty.
        names = {"operation": self.operation.name, "version": self.operation.version}
        return self.conn.execute(_STATE, names).one()

    def _run_operation(self) -> Outcome:
        return self.engine.run(self.operation, key=KEY, params=self.params, scope=self.scope)

    # -- watching the operation ------------------------------------------------------------

    @contextmanager
    def instrumented(self) -> Iterator[None]:
        """For the exploration: foreign steps counted and their downstream keys noted,
        job deliveries counted, recoverypoint's failure logs quiet."""
        # Connected before anything is changed, so that a database that does not answer
        # leaves the operation, the engine and the logs as they were.
        for db in self.dispose[1:]:
            # Its dialect learns the server's version and settings once, not in each
            # forked process (five round trips each).
            db.connect().close()
        # One connection for the exploration's own reads and resets (a round trip each).
        self.conn = self.engine.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        phases = list(self.operation.phases)
        self.operation.phases[:] = [
            replace(p, fn=self._failing(p.point, p.fn))
            if p.atomic
            else replace(
                p,
                fn=self._failing(p.point, self._watched(p.point, p.fn)),
                reconcile=p.reconcile and self._reconciling(p.point, p.reconcile),
            )
            for p in phases
        ]
        backend = self.engine.jobs
        if backend is not None:
            self.engine.jobs = _Recorder(backend, lambda: self.current)
        log = logging.getLogger("recoverypoint")
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            self._end(self.running, self.spare)
            self._reap()
            self.conn.close()
            self.operation.phases[:] = phases
            self.engine.jobs = backend
            log.setLevel(level)

    def _watched(self, point: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(context: Any, params: Any) -> Any:
            run = self.current
            run.calls[point] += 1
            past_window = run.window_passed and point == run.schedule.past_window
            if past_window and point not in run.renewed:
                run.blind[point] += 1
            derive = context.downstream_key

            def downstream_key(name: str | None = None) -> str:
                key: str = derive(name)
                run.downstream.setdefault(point, []).append(key)
                return key

            context.downstream_key = downstream_key
            returned = fn(context, params)
            run.returned[point] += 1
            return returned

        return step

    def _failing(self, point: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, each exception it raises noted with its phase and attempt."""

        def phase(context: Any, params: Any) -> Any:
            try:
                return fn(context, params)
            except Exception as exc:
                run = self.current
                run.raised.append((run.attempt, point, f"{type(exc).__name__}: {exc}"[:300]))
                raise

        return phase

    def _reconciling(self, point: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def reconcile(context: Any, params: Any) -> Any:
            run = self.current
            run.reconciled[point] += 1
            found = hook(context, params)
            if found is NotFound:  # the engine renews the window: a call anew is no blind one
                run.renewed.add(point)
            return found

        return reconcile


def _extensions(
    planned: Schedule,
    run: _Run,
    effects: Sequence[Kind],
    recoveries: Sequence[Recovery],
    windows: Mapping[str, timedelta],
) -> list[Schedule]:
    """Every schedule of one crash more: at each boundary ``run`` reached after its last
    crash, with each effect; a first crash is tried with each way to recover, and, around
    a step with a dedupe window, with recovery after the window too (after the others, so
    that an operation without windows is explored as before). A lost answer (after a
    COMMIT), the engine's connections ended during a step (at its ``before_foreign``
    point), a lease run out (at its ``after_foreign`` point) and a failover that loses a
    commit (after it) are tried as a first crash only, and not extended: what recovers
    from them is what recovers from a raise there, which is explored deeper: they cost a
    schedule a point for each way to recover, not a tree. Failovers come last, so that a
    mistake an ordinary crash finds too is shown with that crash."""
    if planned.crashes and planned.crashes[-1].effect in _FIRST_ONLY:
        return []
    last = planned.crashes[-1].attempt if planned.crashes else 0
    ways = recoveries if not planned.crashes else (planned.recovery,)
    hits = [hit for hit in run.trace if hit.attempt > last]
    late = []
    if not planned.crashes:
        late = [
            (hit, step)
            for hit in hits
            for boundary, _, step in [hit.point.partition(":")]
            if boundary in _AROUND_STEP and step in windows
        ]
    extended = [
        Schedule(way, (*planned.crashes, replace(hit, effect=effect, times=times)), window)
        for hit, window in [*((hit, planned.past_window) for hit in hits), *late]
        for effect in effects
        # A serialization failure happens inside a phase's transaction: before its COMMIT.
        if effect != "conflict" or hit.point.startswith("before_commit:")
        # One crash, at the points of its kind, its recovery in time (not past a window).
        if effect not in _FIRST_ONLY
        or (hit.point.startswith(_FIRST_ONLY[effect]) and not last and window is None)
        for times in [_STORM if effect == "conflict" else 1]
        for way in ways
    ]
    return sorted(extended, key=lambda schedule: schedule.crashes[-1].effect == "failover")


def _driver(conn: sa.Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn``, for COPY."""
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)  # the engine's driver
    return driver


def _answer(returned: object) -> str:
    """What a client got, as it is compared and shown: an Outcome's status, body and
    headers, or what an @idempotent function or a ``request()`` returned."""
    if isinstance(returned, Outcome):
        headers = f" {_json(returned.headers)}" if returned.headers else ""
        return f"{returned.status} {_json(returned.body)}{headers}"
    return repr(returned)


def _json(value: object) -> str:
    return json.dumps(value, default=str, sort_keys=True)


__all__ = [
    "KILLING",
    "KINDS",
    "Crash",
    "Exploration",
    "Failure",
    "Kind",
    "Schedule",
    "Subject",
    "explore",
]
