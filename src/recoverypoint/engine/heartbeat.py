"""The heartbeat: a live holder keeps its lease while its foreign step runs.

A lease may be taken over once its holder has not renewed it for the operation's
``lock_timeout`` (:mod:`recoverypoint.leases`). Every commit renews it, but a foreign step
commits nothing while it runs, and one slower than ``lock_timeout`` would otherwise see a
retry or the completer take its key over and call the provider a second time beside it.
So while a step runs, its attempt renews its lease every third of ``lock_timeout``
(:data:`RENEWALS_PER_LEASE`), fenced by its token (:data:`~recoverypoint.engine.sql.RENEW`).
``lock_timeout`` is then how long after a holder dies (its process killed, its host gone)
another attempt may take over.

A renewal that finds the token gone (an operator's ``keys release --force``, a takeover
after the database was away) stops the renewals and marks the lease lost; so does a lease
whose last renewal is older than ``lock_timeout`` (the database away): the step may ask
(:attr:`~recoverypoint.StepContext.lease_lost`), and its next commit fails with
:class:`~recoverypoint.LockLost` through the token fence, as without a heartbeat.

Renewals must go through when the application is at its worst, so they share nothing
with it. One thread per engine, on both engines (:class:`Heartbeat`), schedules them: on
rp.AsyncEngine too, so that a step that blocks its event loop (a sync call in an
``async def``) keeps its lease. The renewals themselves run on a connection of the
heartbeat's own, outside the engine's pool (a pool kept busy by the application would
hold them back), opened when the first renewal falls due, kept while steps run and closed
with the thread after an idle spell. It is opened with a connect timeout and TCP
keepalives, and its statements end within half an interval (``statement_timeout``,
``lock_timeout``): a renewal that fails is retried at the next one. The scheduling thread
is the watchdog: each batch of renewals runs in a short-lived thread, and one still
running after an interval (a half-open socket) is left behind with its connection, its
leases handed to a fresh connection at once. A forked child forgets its parent's leases,
thread and connection (:func:`os.register_at_fork`): it renews only its own.

What a step costs that ends before its first renewal is due: no round trip, no thread
start, no task. The thread is started with the first step after an idle spell and ends
one interval after the last; a step adds itself to its registry and takes itself off. A
renewal's new row address is kept on its :class:`Lease` and given to the run when the step
ends (:meth:`Heartbeat.drop`), so that only the run's own thread writes its
:class:`~recoverypoint.engine._decide.KeyRef`.

Atomic phases need none: their fence locks the key row for the phase's transaction, so a
claim waits for the row (or, the completer's, skips it) until the phase's commit renews the
lease (tests/test_heartbeat.py shows a phase longer than its lease keeping its key).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import psycopg

from ..outage import is_outage
from . import sql

if TYPE_CHECKING:
    import sqlalchemy as sa

    from ._decide import KeyRef

logger = logging.getLogger("recoverypoint")

RENEWALS_PER_LEASE = 3
"""Renewals per ``lock_timeout``: two may fail (a slow or briefly absent database) before
the lease runs out under a live holder."""


Renewal = str | BaseException | None
"""What a renewal found: the row's new address (the lease held), an error, or ``None`` (the
lease gone)."""


class Lease:
    """The lease of one running foreign step, as its heartbeat keeps it."""

    __slots__ = (
        "ctid",
        "due",
        "gone",
        "interval",
        "key",
        "renewed",
        "renewing",
        "sent_from",
        "timeout",
    )

    def __init__(self, key: KeyRef, timeout: float) -> None:
        self.key = key
        self.timeout = timeout
        self.interval = timeout / RENEWALS_PER_LEASE
        # On this host's monotonic clock: when it was last known renewed (the step's start
        # stands for the commit just before it), and when its next renewal is due.
        self.renewed = time.monotonic()
        self.due = self.renewed + self.interval
        self.gone = False
        """A renewal found the token gone: released or taken over; never renewed again."""
        self.renewing = False
        """Its renewal is in flight."""
        self.ctid: str | None = None
        """The row's address after the last renewal, for the run's next fence."""
        self.sent_from = ""
        """The run's address of the row when that renewal was sent: the renewal's is newer
        only if the run wrote nothing since."""

    @property
    def lost(self) -> bool:
        """Whether another attempt may hold the key now (see
        :attr:`~recoverypoint.StepContext.lease_lost`)."""
        return self.gone or time.monotonic() - self.renewed > self.timeout

    def settle(self) -> None:
        """Give the run the row's address the last renewal left, once the step ended (the
        run's thread alone writes its key)."""
        if self.ctid is not None and self.key.ctid == self.sent_from:
            self.key.ctid = self.ctid

    def record(self, sent: float, held: Renewal) -> None:
        """What the renewal sent at ``sent`` found."""
        if isinstance(held, str):
            self.renewed, self.ctid = sent, held
        elif held is None:
            logger.warning(
                "key %s lost its lease while a foreign step ran (released by an operator, or "
                "taken over): its next commit fails with LockLost",
                self.key.id,
            )
            self.gone = True  # after the warning: a step that sees it finds it logged
        elif is_outage(held) or isinstance(held, _LATE):
            logger.warning(
                "could not renew the lease of key %s (the database is away or slow: %s); "
                "retried at its next renewal",
                self.key.id,
                held,
            )
        else:
            logger.error("could not renew the lease of key %s", self.key.id, exc_info=held)


class RenewalTimedOut(Exception):
    """A renewal still unanswered after a renewal interval: its connection was left behind."""


_LATE = (RenewalTimedOut, psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)
"""A renewal that ran out of time: the watchdog's interval, or the connection's timeouts."""

_MISSED = RenewalTimedOut()
"""A renewal of a batch left behind."""


class _Link:
    """The heartbeat's own connection to the database, outside the engine's pool."""

    def __init__(self, db: sa.Engine) -> None:
        self._db = db
        self._connection: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._busy = False
        self._abandoned = False

    def renew(self, due: list[Lease], results: dict[Lease, Renewal]) -> None:
        """Renew each lease of ``due`` in turn, into ``results`` (a batch's thread)."""
        try:
            for lease in due:
                if self._abandoned:  # the watchdog handed the rest to a fresh connection
                    break
                try:
                    results[lease] = self._renew(lease)
                except Exception as exc:
                    results[lease] = exc
                    self.close()  # maybe broken: the next renewal connects afresh
        finally:
            with self._lock:
                self._busy = False
                abandoned = self._abandoned
            if abandoned:
                self.close()

    def start(self, due: list[Lease], results: dict[Lease, Renewal]) -> threading.Thread:
        """Renew ``due`` in a thread of its own."""
        self._busy = True
        worker = threading.Thread(
            target=self.renew, args=(due, results), name="recoverypoint-renewal", daemon=True
        )
        worker.start()
        return worker

    def abandon(self) -> bool:
        """Give up on a batch still running (it closes the connection when it ends);
        ``False`` if it has ended meanwhile."""
        with self._lock:
            self._abandoned = self._busy
        return self._abandoned

    def _renew(self, lease: Lease) -> str | None:
        key = lease.key
        # Every wait ends within half an interval, so that a failure is known (and retried)
        # before the next renewal falls due.
        timeout_ms = max(1, int(lease.interval * 500))
        if self._connection is None:
            self._connection = self._connect(timeout_ms / 1000)
        connection = self._connection
        params = {"scope": key.scope, "id": key.id, "token": key.token}
        # The timeouts are the transaction's own: behind a pooler in transaction mode, a
        # session's setting would stay with a server connection that other clients get.
        with connection.transaction():
            connection.execute(sql.RENEWER_TIMEOUTS, {"timeout": f"{timeout_ms}ms"})
            row = connection.execute(sql.RENEW, params).fetchone()
        return None if row is None else str(row[0])

    def _connect(self, timeout: float) -> psycopg.Connection[Any]:
        """A connection to the engine's database, as its URL says (``connect_args`` given to
        create_engine are the pool's alone), that gives up on a silent server: at connect,
        and through TCP keepalives and ``tcp_user_timeout`` once connected."""
        cargs, cparams = self._db.dialect.create_connect_args(self._db.url)
        seconds = max(1, math.ceil(timeout))
        return psycopg.connect(
            *cargs,
            **{
                **cparams,
                "autocommit": True,
                # Never prepared: behind a pooler the next renewal may reach another
                # server connection, which does not know the statement.
                "prepare_threshold": None,
                "connect_timeout": max(2, seconds),  # libpq's least
                "keepalives": 1,
                "keepalives_idle": seconds,
                "keepalives_interval": seconds,
                "keepalives_count": 2,
                "tcp_user_timeout": max(1, int(timeout * 1000)),
                "application_name": "recoverypoint-heartbeat",
            },
        )

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except Exception:  # a broken connection: nothing more to do
                logger.debug("closing the heartbeat's connection failed", exc_info=True)


# Every heartbeat of this process, reset in a forked child.
_heartbeats: weakref.WeakSet[Heartbeat] = weakref.WeakSet()
# The connections a forked child inherited: never closed nor collected there, as closing
# one would end its parent's session.
_inherited: list[_Link] = []


class Heartbeat:
    """One thread per engine renews the leases of the steps in flight on the engine, on a
    connection of its own."""

    def __init__(self, db: sa.Engine) -> None:
        self._db = db
        self._reset()
        _heartbeats.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        # The leases of the steps in flight, by renewal interval; each dict in the order its
        # leases fall due (a renewed lease moves to its end), so the first is the next due.
        self._leases: dict[float, dict[Lease, None]] = {}
        self._thread: threading.Thread | None = None
        self._link = _Link(self._db)
        """The connection renewals run on, opened at the first (lazily), and replaced when
        the thread ends idle or a batch on it outlives its interval."""
        self._wake_at = math.inf
        """When the renewer thread next looks (monotonic); a lease due earlier wakes it."""
        self._held = False
        """A step began since the renewer last looked: it stays for one interval more."""

    def _forked(self) -> None:
        """In a forked child: the parent's leases, thread and connection are not ours."""
        _inherited.append(self._link)
        self._reset()

    def hold(self, key: KeyRef, timeout: float) -> Lease:
        """Keep the lease of ``key`` (``timeout``: its lock timeout) renewed until :meth:`drop`."""
        lease = Lease(key, timeout)
        with self._cond:
            self._leases.setdefault(lease.interval, {})[lease] = None
            self._held = True
            if self._thread is None:
                self._wake_at = lease.due
                self._thread = threading.Thread(
                    target=self._beat, name="recoverypoint-heartbeat", daemon=True
                )
                self._thread.start()
            elif lease.due < self._wake_at:
                self._cond.notify()
        return lease

    def quiesce(self) -> None:
        """End the renewer thread now, if no step is in flight, and wait for it to end."""
        with self._cond:
            thread = self._thread
            if thread is None or any(self._leases.values()):
                return
            self._held = False
            self._cond.notify()
        thread.join()

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``; a renewal in flight is waited for (an interval at most),
        and the row's address it left given to the run, for its next fence."""
        with self._cond:
            self._leases[lease.interval].pop(lease, None)
            while lease.renewing:
                self._cond.wait()
        lease.settle()

    def _beat(self) -> None:
        while True:
            with self._cond:
                due = self._due_now()
                while not due:
                    fronts = [next(iter(d)).due for d in self._leases.values() if d]
                    if not fronts and not self._held:  # idle: the next step starts another
                        self._thread, self._wake_at = None, math.inf
                        idle, self._link = self._link, _Link(self._db)
                        break
                    # With no step in flight, it stays one interval (the shortest it knows) for
                    # the next: a steady stream of short steps never starts nor wakes it.
                    self._held = False
                    self._wake_at = min(fronts, default=time.monotonic() + min(self._leases))
                    self._cond.wait(self._wake_at - time.monotonic())
                    due = self._due_now()
                link = self._link
            if not due:
                idle.close()  # outside the lock: the next thread has a link of its own
                return
            self._renew(link, due)

    def _due_now(self) -> list[Lease]:
        """The leases due for renewal, marked in flight and moved to the end of their dict,
        due again an interval from now (under the lock)."""
        now = time.monotonic()
        due = []
        for leases in self._leases.values():
            while leases:
                lease = next(iter(leases))
                if lease.due > now:
                    break
                del leases[lease]
                lease.renewing, lease.due = True, now + lease.interval
                lease.sent_from = lease.key.ctid
                leases[lease] = None
                due.append(lease)
        return due

    def _renew(self, link: _Link, due: list[Lease]) -> None:
        """Renew ``due`` on ``link``, waiting an interval at most: a batch that outlives it
        is left behind with its connection, and its leases not yet renewed are due again."""
        results: dict[Lease, Renewal] = {}
        sent = time.monotonic()
        link.start(due, results).join(min(lease.interval for lease in due))
        with self._cond:
            if link.abandon():
                self._link = _Link(self._db)
            for lease in due:
                held = results.get(lease, _MISSED)
                if held is _MISSED:
                    held = RenewalTimedOut(f"no answer within {lease.interval:.3g} s")
                    self._retry_now(lease)
                lease.record(sent, held)
                lease.renewing = False
                if lease.gone:
                    self._leases[lease.interval].pop(lease, None)
            self._cond.notify_all()

    def _retry_now(self, lease: Lease) -> None:
        """Make ``lease`` due now, first of its dict, for the fresh connection (under the
        lock; rare: a batch left behind)."""
        leases = self._leases[lease.interval]
        if lease in leases:  # not dropped meanwhile
            del leases[lease]
            lease.due = time.monotonic()
            self._leases[lease.interval] = {lease: None, **leases}


class AsyncHeartbeat(Heartbeat):
    """rp.AsyncEngine's: the same thread, so that a step blocking its event loop keeps its
    lease; only a step's end waits for a renewal in flight off the loop."""

    async def drop(self, lease: Lease) -> None:  # type: ignore[override]
        """:meth:`Heartbeat.drop`, awaited in a thread when a renewal is in flight (an
        interval at most)."""
        with self._cond:  # never held across a wait: the loop does not block on it
            self._leases[lease.interval].pop(lease, None)
            renewing = lease.renewing
        if renewing:
            await asyncio.to_thread(super().drop, lease)
        else:
            lease.settle()


def _forked() -> None:
    for heartbeat in list(_heartbeats):
        heartbeat._forked()


def quiesce() -> None:
    """End every idle renewer thread of this process (one stays an interval after each
    step): for a caller about to fork, whose child would otherwise be forked from a
    multi-threaded process (Python warns, and a child forked while another thread holds
    a lock may deadlock)."""
    for heartbeat in list(_heartbeats):
        heartbeat.quiesce()


os.register_at_fork(after_in_child=_forked)
