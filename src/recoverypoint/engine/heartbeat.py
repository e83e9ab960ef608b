"""The heartbeat: a live holder keeps its lease while its foreign step runs.

A lease may be taken over once its holder has not renewed it for the operation's
``lock_timeout`` (:mod:`recoverypoint.leases`). Every commit renews it, but a foreign step
commits nothing while it runs, and one slower than ``lock_timeout`` would otherwise see a
retry or the completer take its key over and call the provider a second time beside it.
So while a step runs, its attempt renews its lease every third of ``lock_timeout``
(:data:`RENEWALS_PER_LEASE`), fenced by its token (:data:`~recoverypoint.engine.sql.RENEW`),
in one statement on a connection borrowed for it alone: no connection is held across the
step. ``lock_timeout`` is then how long after a holder dies (its process killed, its host
gone) another attempt may take over.

A renewal that finds the token gone (an operator's ``keys release --force``, a takeover
after the database was away) stops the renewals and marks the lease lost; so does a lease
whose last renewal is older than ``lock_timeout`` (the database away): the step may ask
(:attr:`~recoverypoint.StepContext.lease_lost`), and its next commit fails with
:class:`~recoverypoint.LockLost` through the token fence, as without a heartbeat.

What a step costs that ends before its first renewal is due: no round trip, no thread, no
task. rp.Engine keeps one renewer thread per engine (:class:`Heartbeat`), started with the
first step after an idle spell and ended after one, which sleeps until the earliest
renewal falls due; a step adds itself to its registry and takes itself off. rp.AsyncEngine
schedules one timer per step on the running loop (:class:`AsyncHeartbeat`), cancelled when
the step ends; a renewal due runs in a task of its own.

Atomic phases need none: their fence locks the key row for the phase's transaction, so a
claim waits for the row (or, the completer's, skips it) until the phase's commit renews the
lease (tests/test_heartbeat.py shows a phase longer than its lease keeping its key).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from ..outage import is_outage
from . import _pg_async, store, store_async

if TYPE_CHECKING:
    import sqlalchemy as sa
    import sqlalchemy.ext.asyncio as sa_async

    from ._decide import KeyRef

logger = logging.getLogger("recoverypoint")

RENEWALS_PER_LEASE = 3
"""Renewals per ``lock_timeout``: two may fail (a slow or briefly absent database) before
the lease runs out under a live holder."""


class Lease:
    """The lease of one running foreign step, as its heartbeat keeps it."""

    __slots__ = ("due", "gone", "handle", "interval", "key", "renewed", "renewing", "timeout")

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
        """rp.Engine: its renewal is in flight on the renewer thread."""
        self.handle: asyncio.TimerHandle | asyncio.Task[None] | None = None
        """rp.AsyncEngine: the timer of its next renewal, or the task of the one in flight."""

    @property
    def lost(self) -> bool:
        """Whether another attempt may hold the key now (see
        :attr:`~recoverypoint.StepContext.lease_lost`)."""
        return self.gone or time.monotonic() - self.renewed > self.timeout

    def record(self, sent: float, held: bool | BaseException) -> None:
        """What the renewal sent at ``sent`` found: the lease ``held``, or an error."""
        if held is True:
            self.renewed = sent
        elif held is False:
            logger.warning(
                "key %s lost its lease while a foreign step ran (released by an operator, or "
                "taken over): its next commit fails with LockLost",
                self.key.id,
            )
            self.gone = True  # after the warning: a step that sees it finds it logged
        elif is_outage(held):
            logger.warning(
                "could not renew the lease of key %s (the database is away)", self.key.id
            )
        else:
            logger.error("could not renew the lease of key %s", self.key.id, exc_info=held)


class Heartbeat:
    """rp.Engine's: one renewer thread, started lazily, renews the leases of the steps in
    flight on the engine, each on its own connection use."""

    def __init__(self, db: sa.Engine) -> None:
        self._db = db
        self._cond = threading.Condition(threading.Lock())
        # The leases of the steps in flight, by renewal interval; each dict in the order its
        # leases fall due (a renewed lease moves to its end), so the first is the next due.
        self._leases: dict[float, dict[Lease, None]] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf
        """When the renewer thread next looks (monotonic); a lease due earlier wakes it."""
        self._held = False
        """A step began since the renewer last looked: it stays for one interval more."""

    def hold(self, key: KeyRef, timeout: float) -> Lease:
        """Keep the lease of ``key`` (``timeout``: its lock timeout) renewed until :meth:`drop`."""
        lease = Lease(key, timeout)
        with self._cond:
            self._leases.setdefault(lease.interval, {})[lease] = None
            self._held = True
            # Not alive: ended in the parent of this forked process (a pre-forking server).
            if self._thread is None or not self._thread.is_alive():
                self._wake_at = lease.due
                self._thread = threading.Thread(
                    target=self._beat, name="recoverypoint-heartbeat", daemon=True
                )
                self._thread.start()
            elif lease.due < self._wake_at:
                self._cond.notify()
        return lease

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``; a renewal in flight is waited for, so that the run's next
        fence finds the row at the address that renewal left."""
        with self._cond:
            self._leases[lease.interval].pop(lease, None)
            while lease.renewing:
                self._cond.wait()

    def _beat(self) -> None:
        while True:
            with self._cond:
                due = self._due_now()
                while not due:
                    fronts = [next(iter(d)).due for d in self._leases.values() if d]
                    if not fronts and not self._held:  # idle: the next step starts another
                        self._thread, self._wake_at = None, math.inf
                        return
                    # With no step in flight, it stays one interval (the shortest it knows) for
                    # the next: a steady stream of short steps never starts nor wakes it.
                    self._held = False
                    self._wake_at = min(fronts, default=time.monotonic() + min(self._leases))
                    self._cond.wait(self._wake_at - time.monotonic())
                    due = self._due_now()
            for lease in due:
                sent = time.monotonic()
                held: bool | BaseException
                try:
                    held = store.renew(self._db, lease.key)
                except Exception as exc:
                    held = exc
                with self._cond:
                    lease.record(sent, held)
                    lease.renewing = False
                    if lease.gone:
                        self._leases[lease.interval].pop(lease, None)
                    self._cond.notify_all()

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
                leases[lease] = None
                due.append(lease)
        return due


class AsyncHeartbeat:
    """rp.AsyncEngine's: a timer per step on the running loop; each renewal in a task, on
    its own connection use."""

    def __init__(self, db: sa_async.AsyncEngine) -> None:
        self._db = db

    def hold(self, key: KeyRef, timeout: float) -> Lease:
        """Keep the lease of ``key`` (``timeout``: its lock timeout) renewed until :meth:`drop`."""
        lease = Lease(key, timeout)
        lease.handle = asyncio.get_running_loop().call_later(lease.interval, self._due, lease)
        return lease

    async def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease``; a renewal in flight is waited for, so that the run's next
        fence finds the row at the address that renewal left."""
        handle, lease.handle = lease.handle, None
        if isinstance(handle, asyncio.Task):
            await _pg_async.shielded(_finished, handle)
        elif handle is not None:
            handle.cancel()

    def _due(self, lease: Lease) -> None:
        lease.handle = asyncio.get_running_loop().create_task(self._renew(lease))

    async def _renew(self, lease: Lease) -> None:
        sent = time.monotonic()
        held: bool | BaseException
        try:
            held = await store_async.renew(self._db, lease.key)
        except Exception as exc:
            held = exc
        lease.record(sent, held)
        if lease.handle is not None and not lease.gone:  # not dropped meanwhile
            lease.handle = asyncio.get_running_loop().call_later(lease.interval, self._due, lease)


async def _finished(task: asyncio.Task[None]) -> None:
    await task
