"""The shape every worker shares: ``run_once()`` returns counts, ``run_forever()`` repeats it
until stopped, and SIGTERM/SIGINT become a stop in one place (:func:`on_stop`).

A pass (``run_once``) works in batches, one transaction each, until a batch comes back
short or a stop is requested; a stop is only looked at between batches, so a batch always
commits or rolls back whole. Log lines are ``key=value`` pairs (logfmt), one event each.

Where the keys are distributed by scope (Citus), every claim a worker makes is in one
scope: :meth:`Worker.scopes_due` lists the scopes with work due, reading without locks (a
read, which Citus runs on every shard), then each scope is claimed with ``FOR UPDATE SKIP
LOCKED`` in a statement that names it, which runs on the one shard that holds the scope,
where ``SKIP LOCKED`` works. On a single server (:attr:`Worker.distributed` false) the
reaper's deletions and the enqueuer's and the completer's claims take rows of every scope
at once instead (:class:`Rows`), as a stream of finished keys, of keys their clients left,
or of staged jobs, spread over many scopes would outrun a transaction per scope (the
compensator, whose keys are few, still goes scope by scope, :meth:`Worker.by_scope`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar, Generic, TypeVar

import sqlalchemy as sa

from ..engine import store
from ..leases import REGISTERED, free
from ..logfmt import logfmt
from ..outage import is_outage
from .engines import AnyEngine, Engines

logger = logging.getLogger("recoverypoint.workers")

_HOST = socket.gethostname()

SCOPES_PER_PASS = 1000
"""The scopes a pass works through at most; the next pass takes the rest."""

# Full batches a pass takes in a row at most (Worker.in_batches), of every scope or of one:
# a stream of rows falling due as fast as a batch takes them would otherwise keep one pass
# running, never recorded for doctor, the pass's other work (the completer's compensations)
# never reached. The next pass goes on.
BATCHES_PER_PASS = 1000


@dataclass(frozen=True)
class Rows:
    """Whose rows a batch of the reaper, the enqueuer or the completer takes. Of one scope
    (``:scope``) where the keys are distributed (Citus), so that the batch runs on the
    scope's shard alone; of every scope at once on one server, where a transaction per scope
    would bound the worker by the number of scopes rather than of rows (a busy table has
    keys finishing, keys left unfinished, and jobs staged, in more scopes a minute than a
    pass could take one by one). A row the reaper deletes or the completer reserves is
    matched in its own scope, never on the word of another scope's row, and, of every
    scope, by its address (``ctid``) too: joined by its columns alone, a batch hashed the
    whole table wherever the planner costed that below an index probe per row (up to some
    120,000 keys over 10,000 scopes, whose larger index costs more a probe: 26 ms of a
    batch's 34 at 100,000), where a row found by its address costs one page, the cheaper
    plan from some 75,000 keys up. A staged job is unlinked, or deleted once published, by
    its id, an identity unique across scopes."""

    one_scope: bool

    @property
    def only(self) -> str:
        """The condition that keeps a batch in its scope, to prefix others with."""
        return "scope = :scope AND " if self.one_scope else ""

    def chosen(self, table: str) -> str:
        """What the choosing CTE selects of each row of ``table`` (its name or alias) besides
        its identity, for :meth:`same`: of every scope, its scope and its address."""
        return "" if self.one_scope else f", {table}.scope, {table}.ctid"

    def same(self, alias: str, chosen: str) -> str:
        """The condition that the rows written, ``alias``, are those in the scope and at
        the address (of every scope) of the rows ``chosen`` (the statement's choosing CTE
        and what it selected, :meth:`chosen`). Their identity is matched beside it.

        A row another transaction updated after the statement's snapshot, and committed
        before the choosing CTE locked it, is locked at its new address, which that
        snapshot does not see: it is left unwritten until the batch commits, for a later
        batch to take, or the next pass, as the batch comes back short (a key whose lease
        was renewed, say, is no longer due anyway)."""
        if self.one_scope:
            return f"{alias}.scope = :scope"
        return f"{alias}.ctid = {chosen}.ctid AND {alias}.scope = {chosen}.scope"


IN_SCOPE, EVERY_SCOPE = Rows(one_scope=True), Rows(one_scope=False)

_RECORD_PASS = sa.text(
    """
    INSERT INTO worker_passes (worker, host, pid, last_pass_at, last_error, interval_seconds)
    VALUES (:worker, :host, :pid, now(), :error, :interval)
    ON CONFLICT (worker, host) DO UPDATE
    SET pid = excluded.pid, last_pass_at = excluded.last_pass_at,
        last_error = excluded.last_error, interval_seconds = excluded.interval_seconds
    """
)


def registered_scopes(due: str, due_at: str) -> sa.TextClause:
    """The listing for :meth:`Worker.scopes_due` of the scopes with keys of registered
    operations (:data:`~recoverypoint.leases.REGISTERED`) that are ``due`` (SQL on key row
    ``k``) and whose lease is free, the longest due by ``due_at`` first."""
    return sa.text(
        f"""
        WITH {REGISTERED}
        SELECT k.scope
        FROM idempotency_keys AS k
        JOIN registered AS r ON r.operation = k.operation AND r.version = k.operation_version
        WHERE {due} AND {free("r.lock_timeout")}
        GROUP BY k.scope ORDER BY min({due_at}) LIMIT :scopes
        """
    )


@dataclass
class Result:
    """What one pass did; true when it did anything. Subclasses add their counts."""

    batches: int = 0
    # Counts that describe the pass without being work it did.
    _not_work: ClassVar[tuple[str, ...]] = ("batches",)

    def __bool__(self) -> bool:
        return any(value for name, value in self.counts().items() if name not in self._not_work)

    @property
    def stranded(self) -> int:
        """The keys or jobs the pass found that no running worker can finish (their
        operation registered with none, no handler for them): ``--once`` then fails."""
        return 0

    def counts(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def add(self, other: Result) -> None:
        """Add ``other``'s counts (a result of the same kind) to these."""
        for name, value in other.counts().items():
            setattr(self, name, getattr(self, name) + value)


R = TypeVar("R", bound=Result)


STRUCTURED = "recoverypoint_logfmt"
"""Set on log records whose message is already logfmt (see :func:`log_event`)."""


def log_event(
    level: int, event: str, fields: Mapping[str, object], *, exc_info: bool = False
) -> None:
    """Log one event as a logfmt line on the ``recoverypoint.workers`` logger."""
    message = logfmt(event=event, **fields)
    logger.log(level, message, exc_info=exc_info, extra={STRUCTURED: True})


class Worker(ABC, Generic[R]):
    """A worker: ``run_once()`` for one pass, ``run_forever()`` for the loop, ``stop()``
    from anywhere (a signal handler, another thread), as often as you like.

    Parameters
    ----------
    engine:
        The :class:`~recoverypoint.Engine` or :class:`~recoverypoint.AsyncEngine` whose
        database, operations and job backend the worker uses; an application with both
        passes both, ``(engine, async_engine)``, which must share one database.
    batch_size:
        Rows claimed per transaction; small batches keep locks short and let many
        instances share the work.
    stop_event:
        Share one event between workers to stop them together (``worker all``).
    app:
        How the application was named to the command (its ``--app`` options), which the
        errors about what it lacks (an operation, a job's handler) name.
    """

    name: ClassVar[str]
    default_batch_size: ClassVar[int]
    default_interval: ClassVar[float]
    """Seconds between passes when there is nothing to do."""

    def __init__(
        self,
        engine: AnyEngine | Sequence[AnyEngine],
        *,
        batch_size: int | None = None,
        stop_event: threading.Event | None = None,
        app: Sequence[str] = (),
    ) -> None:
        self.engines = Engines(engine, self.name)
        self.app = tuple(app)
        self.batch_size = self.default_batch_size if batch_size is None else batch_size
        if self.batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, got {self.batch_size}")
        self.stop_event = stop_event or threading.Event()
        # Workers claim with SKIP LOCKED and must see each other's commits at once,
        # whatever isolation the application's engine defaults to.
        self.db: sa.Engine = self.engines.db.execution_options(isolation_level="READ COMMITTED")
        self._down_since: float | None = None  # when the database went away, if it has
        self.longest_wait: float | None = None
        """Seconds between two passes at most, while :meth:`run_forever` runs them."""

    @abstractmethod
    def run_once(self) -> R:
        """One pass: batches until a short one or a stop; returns what it did."""

    def scopes_due(self, listing: sa.TextClause, params: Mapping[str, object]) -> list[str]:
        """The scopes ``listing`` names (those with work waiting longest first, up to
        :data:`SCOPES_PER_PASS`), read without locks."""
        with self.db.connect() as conn:
            return list(conn.execute(listing, {**params, "scopes": SCOPES_PER_PASS}).scalars())

    def by_scope(
        self, listing: sa.TextClause, params: Mapping[str, object], batch: Callable[[str], int]
    ) -> None:
        """Run ``batch(scope)`` (one transaction, returning how many rows it claimed) for
        each scope the listing names, again while a batch comes back full (see
        :meth:`in_batches`), until a stop."""
        for scope in self.scopes_due(listing, params):
            self.in_batches(functools.partial(batch, scope))
            if self.stopping:
                return

    def in_batches(self, batch: Callable[[], int]) -> None:
        """Run ``batch()`` (one transaction, returning how many rows it claimed) until one
        comes back short, a stop, or :data:`BATCHES_PER_PASS` full ones."""
        for _ in range(BATCHES_PER_PASS):
            if self.stopping or batch() < self.batch_size:
                return

    @functools.cached_property
    def distributed(self) -> bool:
        """Whether ``idempotency_keys`` is distributed by scope (Citus), where the reaper,
        the enqueuer and the completer too take rows scope by scope, each on its scope's
        shard. Asked once: a worker started before ``recoverypoint migrate --citus`` is
        restarted after it. :class:`ConfigurationError` where the keys are distributed
        without this release's triggers (the completer runs phases)."""
        return store.distributed(self.engines.db)

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def run_forever(self, interval: float | None = None, jitter: float | None = None) -> None:
        """Run passes until :meth:`stop`, waiting ``interval`` plus up to ``jitter`` seconds
        (default a tenth of the interval) between them. An error in a pass (the database
        went away, say) is logged and the next pass tries again."""
        interval = self.default_interval if interval is None else interval
        jitter = interval / 10 if jitter is None else jitter
        if interval < 0 or jitter < 0:
            raise ValueError(f"{self.name}: interval and jitter must be >= 0")
        self.longest_wait = interval + jitter
        self.log(logging.INFO, "started", interval=interval, batch_size=self.batch_size)
        while not self.stopping:
            began = time.monotonic()
            try:
                result = self.run_once()
            except Exception as exc:
                if is_outage(exc):
                    self._database_down(exc, interval)
                else:
                    self.log_error("error", exc)
                    self._record_pass(describe(exc), interval + jitter)
            else:
                if self._down_since is not None:
                    down_for = round(time.monotonic() - self._down_since, 1)
                    self.log(logging.WARNING, "database_back", seconds_down=down_for)
                    self._down_since = None
                if result:
                    self.log_pass(result, seconds=round(time.monotonic() - began, 3))
                self._record_pass(None, interval + jitter)
            self.stop_event.wait(interval + random.uniform(0, jitter))
        self.log(logging.INFO, "stopped")

    def _database_down(self, exc: BaseException, interval: float) -> None:
        """One line when an outage begins (not one per pass, nor a traceback: the database
        is down, not the worker), and nothing recorded in a database that cannot take it."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.log(
                logging.WARNING,
                "database_unavailable",
                error=describe(exc),
                retry_every=interval,
                action="check the database and the URL; the worker resumes by itself",
            )

    def _record_pass(self, error: str | None, interval: float | None) -> None:
        """Note the pass in ``worker_passes`` for ``recoverypoint doctor`` and the console,
        with the longest wait until the next one (``interval``: how they tell a stopped
        worker); a database that cannot take it (the pass failed for that reason) is not
        worth another log line."""
        fields = {
            "worker": self.name,
            "host": _HOST,
            "pid": os.getpid(),
            "error": error,
            "interval": interval,
        }
        try:
            with self.db.begin() as conn:
                conn.execute(_RECORD_PASS, fields)
        except sa.exc.SQLAlchemyError:  # a pool timeout too
            logger.debug("could not record the pass of %s", self.name, exc_info=True)

    def log(self, level: int, event: str, **fields: object) -> None:
        log_event(level, event, {"worker": self.name, **fields})

    def how_to_register(self, what: str) -> str:
        """What to do so that the application this worker loads registers ``what`` (an
        operation version, a job's handler) it lacks."""
        if not self.app:
            return f"register {what} with the engine the workers are given, then restart them"
        modules = ", ".join(dict.fromkeys(spec.partition(":")[0] for spec in self.app))
        return (
            f"import the module that registers {what} from the --app module ({modules}); "
            "under Django, from an installed app's idempotency module; then "
            "restart the workers"
        )

    def log_error(self, event: str, exc: BaseException, **fields: object) -> None:
        """Log ``exc`` as an error event, in one line, its traceback as the ``exc`` field."""
        fields = {"worker": self.name, **fields, "error": describe(exc)}
        log_event(logging.ERROR, event, fields, exc_info=True)

    def log_pass(self, result: Result, **fields: object) -> None:
        log_event(logging.INFO, "pass", {"worker": self.name, **result.counts(), **fields})


def describe(exc: BaseException) -> str:
    """An error in one line: its type and its first line."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


@contextmanager
def on_stop(stop: Callable[[], None]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call ``stop`` (workers finish their batch and
    return); a second signal raises :class:`KeyboardInterrupt` to stop at once, rolling
    the batch back. The previous handlers come back on exit. Off the main thread, where
    Python cannot install handlers, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        log_event(
            logging.INFO, "signal", {"signal": signal.Signals(signum).name, "count": len(received)}
        )
        if len(received) > 1:
            raise KeyboardInterrupt
        stop()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
