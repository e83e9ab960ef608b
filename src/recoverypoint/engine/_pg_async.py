"""The psycopg transaction under every request: BEGIN, COMMIT, and the retry of a
transaction that hit a serialization failure or a deadlock.

The request path borrows a connection from the SQLAlchemy engine's pool (the application's
own settings apply) and hands it back as it came. psycopg sends no BEGIN of its own on it,
and the transaction (:class:`AsyncTransaction`) writes out:

- a statement before the transaction (:meth:`AsyncTransaction.lookup`) runs on its own, the
  way a replay needs it: one round trip, nothing to commit;
- ``BEGIN ISOLATION LEVEL SERIALIZABLE`` goes with the transaction's first statement
  (:meth:`AsyncTransaction.fetch`) or just before it (:meth:`AsyncTransaction.execute`,
  :meth:`AsyncTransaction.fetchone`);
- ``COMMIT`` goes with the write that records the phase
  (:meth:`AsyncTransaction.fetch_and_commit`), or alone (:meth:`AsyncTransaction.commit`).

The engine's own statements go through libpq (:mod:`recoverypoint.engine._libpq_async`):
prepared once per connection, BEGIN and COMMIT in one pipeline with the statement beside
them, and with nothing outside a transaction that psycopg would begin one for, the
connection keeps the pool's mode. Phase code's statements go through psycopg's cursors.

Phase code that wants SQLAlchemy gets a ``Connection`` on the same transaction, made on first
use (:meth:`AsyncTransaction.sqlalchemy`); it may not commit or roll back (see phase_guard).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from sqlalchemy.util import greenlet_spawn

from ..backoff import backoff_delay
from ..errors import ConcurrentUpdate
from ..observe import Observer
from ..outage import drop_older_connections
from . import _libpq_async, _waiter, sql
from .conflicts import is_conflict, sqlstate

T = TypeVar("T")
if TYPE_CHECKING:  # the arguments a unit of work is passed, typed; nothing at run time
    from typing_extensions import TypeVarTuple, Unpack

    Ts = TypeVarTuple("Ts")
TextRow = tuple[str | None, ...]

# Each transaction's token (sql.mark): unique in the process, and a session only ever sees
# its own process's.
_tokens = itertools.count(1)

# What psycopg answers by deallocating every statement prepared on the connection (it
# reads the command status; this reads the statement, and errs on the side of more).
_DEALLOCATING_WORDS = ("ROLLBACK", "DROP", "ALTER", "DISCARD", "DEALLOCATE")
_DEALLOCATES = re.compile(rf"\b(?:{'|'.join(_DEALLOCATING_WORDS)})\b", re.IGNORECASE)


def _deallocates(statement: str) -> bool:
    """Whether ``statement`` may make psycopg deallocate; the words are looked for first, as
    the pattern alone, tried at every position, cost a tenth of a phase's statement (and a
    loop, as a generator would be resumed once per word)."""
    upper = statement.upper()
    for word in _DEALLOCATING_WORDS:
        if word in upper:
            return _DEALLOCATES.search(statement) is not None
    return False


# Phase code runs the same few statements again and again: the answer is kept for each
# text short enough to keep (a long one writes its values into the text, and would be kept
# once per request).
_deallocates_kept = functools.lru_cache(maxsize=1024)(_deallocates)
_KEPT_LENGTH = 2048


class AsyncTransaction:
    """One SERIALIZABLE transaction on a borrowed connection; made by :func:`serializable`."""

    def __init__(
        self, db: sa_async.AsyncEngine, pooled: Any, connection: psycopg.AsyncConnection[Any]
    ) -> None:
        self.connection = connection
        self.db = db
        self._pooled = pooled
        self._began = False
        self._committed = False
        self._deallocated = False
        self._sqlalchemy: sa.Connection | None = None
        self._engine_cursor: psycopg.AsyncCursor[Any] | None = None
        self.token = str(next(_tokens))
        """The token the transaction holds from its BEGIN to its end (:func:`sql.mark`)."""

    @property
    def _cursor(self) -> psycopg.AsyncCursor[Any]:
        # The engine's own statements share one cursor, made on first use: making one costs
        # about half as much client CPU as running a statement, and the sync engine sends
        # most of its statements through libpq. Phase code gets a cursor of its own per
        # statement, which it may keep.
        if self._engine_cursor is None:
            self._engine_cursor = self.connection.cursor(row_factory=tuple_row)
        return self._engine_cursor

    @property
    def open(self) -> bool:
        """Whether the server still has this transaction open."""
        # libpq's own status: the enum psycopg wraps it in costs more than the comparison.
        return self.connection.pgconn.transaction_status == TransactionStatus.INTRANS

    # -- the engine's own statements, on libpq ----------------------------------------------
    # Both engines the same way: prepared once per connection, BEGIN and COMMIT in one
    # pipeline with the statement beside them; the async one waits on the event loop.

    async def lookup(
        self,
        statement: sql.Statement,
        params: dict[str, Any],
        meanwhile: Callable[[], object] | None = None,
    ) -> TextRow | None:
        """One of the engine's statements on its own, before the transaction begins (a
        replay's lookup); its first row, as text. ``meanwhile``: client work to do with it
        (the request's params checked), on the async engine while the statement is on its
        way."""
        assert not self._began, "a lookup runs before the transaction"
        if True:  # ASYNC
            return await _libpq_async.execute(
                self._pooled, self.connection, statement, params, meanwhile=meanwhile
            )
        else:
            # First: libpq's blocking call for a lone statement costs the client less than
            # a send and a wait on poll() from Python, which cost more than doing the work
            # while the statement was on its way saved (measured on a replay).
            if meanwhile is not None:
                meanwhile()
            return _libpq_async.execute(self._pooled, self.connection, statement, params)

    async def fetch(self, statement: sql.Statement, params: dict[str, Any]) -> TextRow | None:
        """One of the engine's statements in the transaction, BEGIN with it if it is the
        first; its first row, as text."""
        began, self._began = self._began, True
        self._prepare_again()
        begin = None if began else self.token
        return await _libpq_async.execute(
            self._pooled, self.connection, statement, params, begin=begin
        )

    async def fetch_and_commit(
        self, statement: sql.Statement, params: dict[str, Any]
    ) -> TextRow | None:
        """The write that records a phase (or, where the keys are distributed, the last
        statement after it), then COMMIT, in one round trip; its first row, as text. The
        statement raises when it misses its row, so nothing then commits."""
        began, self._began = self._began, True
        self._prepare_again()
        begin = None if began else self.token
        row = await _libpq_async.execute(
            self._pooled, self.connection, statement, params, begin=begin, commit=True
        )
        self._committed = True
        return row

    async def roll_back(self) -> None:
        """ROLLBACK what began, so that the next statement begins the transaction anew;
        through libpq, as psycopg's own would deallocate the engine's statements."""
        await _libpq_async.command(self.connection, b"ROLLBACK")
        self._began = False

    def _prepare_again(self) -> None:
        """After phase code deallocated prepared statements: the engine's, prepared again
        before their next use."""
        if self._deallocated:
            _libpq_async.forget(self._pooled)
            self._deallocated = False

    @property
    def began(self) -> bool:
        """Whether a statement was sent in the transaction (BEGIN with the first)."""
        return self._began

    def _begin_sql(self) -> bytes:
        """BEGIN and the transaction's token (:func:`sql.mark`), as one simple query."""
        return sql.BEGIN + b"; " + sql.mark(self.token)

    async def _begin(self) -> None:
        if not self._began:
            # Through libpq: a cursor would cost as much client CPU as a statement.
            await _libpq_async.command(self.connection, self._begin_sql())
            self._began = True

    # -- on psycopg -------------------------------------------------------------------------

    async def commit(self) -> None:
        """COMMIT, if anything began and nothing committed it; read-only work costs no
        round trip."""
        if self._began and not self._committed:
            await self.connection.commit()
            self._committed = True

    async def execute(
        self, query: str, params: dict[str, Any] | Sequence[Any] | None = None
    ) -> psycopg.AsyncCursor[Any]:
        """Run one statement of phase code in the transaction, on a cursor of its own
        (which notes it, see phase_guard)."""
        if not self._began:
            await self._begin()
        return await self.connection.cursor().execute(query, params)

    def note(self, statement: object) -> None:
        """A statement of phase code. After one that makes psycopg deallocate every prepared
        statement (a ROLLBACK TO SAVEPOINT, DDL), the engine's own are prepared again
        before the write that records the phase."""
        if not isinstance(statement, str) or (
            _deallocates_kept(statement)
            if len(statement) <= _KEPT_LENGTH
            else _deallocates(statement)
        ):
            self._deallocated = True

    async def fetchone(self, query: str, params: dict[str, Any], *, begin: bool = True) -> Any:
        """Run one of the engine's statements on a cursor, in the transaction unless
        ``begin`` is false; its first row."""
        if begin:
            await self._begin()
        await self._cursor.execute(query, params)
        return await self._cursor.fetchone()

    @property
    def sqlalchemy_made(self) -> sa.Connection | None:
        """The SQLAlchemy Connection of :meth:`sqlalchemy`, if phase code asked for one."""
        return self._sqlalchemy

    def sqlalchemy(self) -> sa.Connection:
        """A SQLAlchemy Connection on this transaction, for phase code that uses one.

        Only the engine ends the transaction: phase code gets it through
        :func:`recoverypoint.engine.phase_guard.refusing_to_end`.
        """
        if self._sqlalchemy is None:
            # Phases run once the claim or the fence began the transaction.
            assert self._began, "a SQLAlchemy Connection joins a transaction already begun"
            if True:  # ASYNC
                conn = sa.Connection(self.db.sync_engine, connection=self._pooled)
            else:
                conn = sa.Connection(self.db, connection=self._pooled)
            conn.begin()  # SQLAlchemy's view of the transaction already open; sends nothing
            self._sqlalchemy = conn
        return self._sqlalchemy

    async def _end_sqlalchemy(self) -> None:
        # After COMMIT or ROLLBACK psycopg is idle, so SQLAlchemy's own commit sends nothing;
        # it only closes SQLAlchemy's view of the transaction. The pooled connection is
        # checked in by `serializable`, not by this Connection.
        # One that SQLAlchemy invalidated (an interrupted statement) has nothing to close.
        if self._sqlalchemy is not None and not self._sqlalchemy.invalidated:
            if True:  # ASYNC
                await greenlet_spawn(sa.Connection.commit, self._sqlalchemy)
            else:
                sa.Connection.commit(self._sqlalchemy)
        self._sqlalchemy = None


async def serializable(
    db: sa_async.AsyncEngine,
    retries: int,
    observer: Observer,
    work: Callable[[AsyncTransaction, Unpack[Ts]], Awaitable[T]],
    /,
    *args: Unpack[Ts],
) -> T:
    """Run ``work(tx, *args)`` in one SERIALIZABLE transaction ``tx`` on a
    connection of ``db``'s pool, again on serialization failure or deadlock with capped,
    jittered backoff, up to ``retries`` times, then :class:`ConcurrentUpdate`. ``observer``
    hears of each retry and of running out.

    A unit of work that may run again is a callable, not a ``with`` block (whose body runs
    once): what it found that its caller needs even when the COMMIT is interrupted travels
    on an object among ``args`` (the engine's claims). ``work`` may COMMIT itself (the write
    that records a phase carries the COMMIT); otherwise it is committed when it returns."""
    # Nothing psycopg would begin a transaction for runs outside one: BEGIN goes out first
    # (libpq), and psycopg sends none of its own inside it. So the connection keeps the
    # pool's mode. Not through borrowed(): its generator would cost a dozen calls per
    # transaction.
    pooled, connection, switched = await _borrow(db, autocommit=False)
    try:
        for attempt in range(retries + 1):
            tx = AsyncTransaction(db, pooled, connection)
            try:
                result = await work(tx, *args)
                await tx.commit()
                return result
            except _libpq_async.Deallocated:
                if attempt == retries:
                    raise
            except (psycopg.Error, sa.exc.DBAPIError) as exc:
                if not is_conflict(exc):
                    raise
                state = sqlstate(exc)
                if attempt == retries:
                    observer.serialization_exhausted(state)
                    raise ConcurrentUpdate() from exc
                observer.serialization_retry(attempt + 1, state)
            finally:
                if _left_over(tx):  # most transactions leave nothing: no cleanup to shield
                    await shielded(_roll_back_leftovers, tx)
            if attempt:  # the first retry at once: most conflicts are false positives
                await asyncio.sleep(backoff_delay(attempt - 1, base=0.005, cap=0.25))
    finally:
        await _give_back(db, pooled, connection, switched)
    raise AssertionError("unreachable")


def _left_over(tx: AsyncTransaction) -> bool:
    """Whether the transaction left anything for :func:`_roll_back_leftovers`."""
    return tx.sqlalchemy_made is not None or _still_open(tx.connection)


def _still_open(connection: psycopg.AsyncConnection[Any]) -> bool:
    return not connection.closed and connection.pgconn.transaction_status != TransactionStatus.IDLE


async def _roll_back_leftovers(tx: AsyncTransaction) -> None:
    """Roll back whatever the transaction left open (an error, a refused request)."""
    connection = tx.connection
    if _still_open(connection):
        # A connection that broke cannot roll back: borrowed() drops it from the pool.
        with contextlib.suppress(psycopg.Error):
            await connection.rollback()
        # psycopg then deallocates every statement prepared on the connection, the
        # engine's own among them.
        _libpq_async.forget(tx._pooled)
    if tx.sqlalchemy_made is not None:
        await tx._end_sqlalchemy()


@asynccontextmanager
async def borrowed(
    db: sa_async.AsyncEngine, *, autocommit: bool = True
) -> AsyncIterator[tuple[Any, psycopg.AsyncConnection[Any]]]:
    """A connection of ``db``'s pool, in autocommit mode if asked (a statement on a cursor
    then commits on its own), handed back as the pool gave it (an application's engine may
    be in autocommit itself), or dropped if it broke."""
    pooled, connection, switched = await _borrow(db, autocommit)
    try:
        yield pooled, connection
    finally:
        await _give_back(db, pooled, connection, switched)


async def _borrow(
    db: sa_async.AsyncEngine, autocommit: bool
) -> tuple[Any, psycopg.AsyncConnection[Any], bool]:
    """A pooled connection, its psycopg connection, and whether autocommit was switched on
    for the borrower (see :func:`borrowed`)."""
    pooled: Any  # its driver_connection is psycopg's
    if True:  # ASYNC
        pooled = _checked_out_at_once(db.pool) or await db.raw_connection()
    else:
        pooled = db.raw_connection()
    connection: psycopg.AsyncConnection[Any] = pooled.driver_connection
    if True:  # ASYNC
        _waiter.attach(connection)
    # psycopg's setter costs a wait: only when it changes something.
    switched = autocommit and not connection.autocommit
    if switched:
        try:
            if True:  # ASYNC
                await connection.set_autocommit(True)
            else:
                connection.autocommit = True
        except BaseException:
            await _give_back(db, pooled, connection, switched)
            raise
    return pooled, connection, switched


async def _give_back(
    db: sa_async.AsyncEngine, pooled: Any, connection: psycopg.AsyncConnection[Any], switched: bool
) -> None:
    if True:  # ASYNC
        if not switched and _idle(connection) and _checks_in_at_once(db.pool):
            _hand_back(db.pool, pooled, connection, switched)
            return
        # The pool's own code runs in SQLAlchemy's greenlet.
        await shielded(greenlet_spawn, _hand_back, db.pool, pooled, connection, switched)
    else:
        _hand_back(db.pool, pooled, connection, switched)


if True:  # ASYNC

    def idle_connection(db: sa_async.AsyncEngine) -> bool:
        """Whether ``db``'s pool holds an idle connection, so that a borrow now neither
        waits for one nor makes one (a connection the server dropped looks idle too)."""
        pool = db.pool
        return isinstance(pool, sa.pool.QueuePool) and pool.checkedin() > 0

    def _checked_out_at_once(pool: Any) -> Any:
        """A connection checked out of ``pool`` without SQLAlchemy's greenlet, or ``None``
        when the checkout might wait: a switch into the greenlet and back costs about half
        a borrow (benchmarks/README.md, "The pool's greenlet"), and a fresh request borrows
        twice.

        The checkout cannot wait when the queue pool hands out its next idle connection as
        it is (the first in the queue, or the last with ``pool_use_lifo``): nothing to
        connect, no ping, no listener of the checkout, not invalidated, and not due for
        recycling (SQLAlchemy would close it; a second to spare, as the clock moves on
        between this look and the pool's). What it looks at is the pool's private state:
        a SQLAlchemy that keeps it elsewhere checks every connection out in the greenlet."""
        if type(pool) is not sa.pool.AsyncAdaptedQueuePool:
            return None
        try:
            queue: Any = pool._pool
            idle = queue._queue._queue  # asyncio's own deque (a list if last in, first out)
            if not idle or pool._pre_ping or pool.dispatch.checkout:
                return None
            if not _QUEUE_HANDS_OUT_AT_ONCE and -1 < pool._max_overflow <= pool._overflow:
                return None  # at its limit the pool asks its queue to wait, which awaits
            record = idle[-1] if queue.use_lifo else idle[0]
            if record._is_hard_or_soft_invalidated() or (
                pool._recycle > -1 and time.time() - record.starttime > pool._recycle - 1
            ):
                return None
        except AttributeError:  # a release that keeps these elsewhere: the greenlet's way
            return None
        try:
            return pool.connect()
        except sa.exc.MissingGreenlet:
            # Between the look and the checkout, the garbage collector finalized a
            # connection nobody closed, and the pool put its record, without a connection,
            # last in the queue (with pool_use_lifo, the one handed out): the pool took it
            # back when connecting failed, and the greenlet connects it.
            return None

    def _hands_out_at_once() -> bool:
        """Whether SQLAlchemy's async queue hands out an item it holds without awaiting,
        even when told to wait for one (as the pool does at its limit): 2.1.9 does; 2.0
        and 2.1.1 await the queue, which outside the greenlet raises
        ``MissingGreenlet``."""
        queue: Any = sa.util.queue.AsyncAdaptedQueue()
        item = object()
        queue.put_nowait(item)
        try:
            return bool(queue.get(True, None) is item)
        except sa.exc.MissingGreenlet:  # it closed the queue's wait: nothing left behind
            return False

    _QUEUE_HANDS_OUT_AT_ONCE = _hands_out_at_once()

    def _checks_in_at_once(pool: Any) -> bool:
        """Whether an idle connection goes back into ``pool`` without a round trip, so
        without SQLAlchemy's greenlet (a switch into it and back costs about as much as a
        statement's wait): a queue with room (a full one closes the connection), no reset
        that commits, and nobody listening for the check-in or the reset."""
        return (
            isinstance(pool, sa.pool.QueuePool)
            and pool.checkedin() < pool.size()
            and pool._reset_on_return is not sa.pool.base.reset_commit
            and not pool.dispatch.checkin
            and not pool.dispatch.reset
        )


def _idle(connection: psycopg.AsyncConnection[Any]) -> bool:
    return not connection.closed and connection.pgconn.transaction_status == TransactionStatus.IDLE


def _hand_back(
    pool: Any, pooled: Any, connection: psycopg.AsyncConnection[Any], switched: bool
) -> None:
    if _idle(connection):
        if switched:
            # Through the pool's own connection object: in the async pool it is
            # SQLAlchemy's adapter, which switches psycopg's mode for the pool.
            pooled.dbapi_connection.autocommit = False
        # Idle, so the pool's rollback-on-return would only cost a call into the driver
        # (about 6 % of a replay's client CPU): checked in the way SQLAlchemy's own
        # Connection checks in one whose transaction it ended.
        checkin = getattr(pooled, "_close_special", None)
        if checkin is not None:
            checkin(transaction_reset=True)
            return
    elif pooled.is_valid:  # SQLAlchemy drops a connection whose statement was interrupted
        if connection.broken:  # lost: the server went away, its older siblings with it
            drop_older_connections(pool, pooled)
        pooled.invalidate()  # broken, or stuck in a transaction: never hand it out again
    pooled.close()


async def run_alone(
    db: sa_async.AsyncEngine, query: str, params: dict[str, Any]
) -> tuple[Any, ...] | None:
    """One statement in a transaction of its own (autocommit); its first row."""
    async with borrowed(db) as (_, connection):
        cursor = await connection.execute(query, params)
        return await cursor.fetchone()


if True:  # ASYNC

    async def shielded(cleanup: Callable[[Unpack[Ts]], Awaitable[T]], /, *args: Unpack[Ts]) -> T:
        """Run ``cleanup(*args)`` to its end even when the caller is cancelled
        meanwhile, once or again and again (as anyio's cancel scopes do); the cancellation
        is raised after it.

        A cancelled request (a timeout, a client gone) still rolls back, gives its lease up
        and hands its connection back this way."""
        task = _eager_task(cleanup(*args))
        if task.done():  # finished without waiting (most do): no trip through the loop
            done: T = task.result()
            return done
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError as exc:
                if task.done():  # the cleanup itself was cancelled (the loop is closing)
                    raise
                cancelled = exc
                continue
            if cancelled is not None:
                raise cancelled
            return result

    def _eager_task(awaitable: Awaitable[T]) -> asyncio.Future[T]:
        """A task of ``awaitable`` that runs at once, up to its first wait (Python 3.12 on;
        before, from the loop's next round)."""
        if _EAGER is None or not asyncio.iscoroutine(awaitable):
            return asyncio.ensure_future(awaitable)
        task: asyncio.Future[T] = _EAGER(asyncio.get_running_loop(), awaitable)
        return task

    _EAGER = getattr(asyncio, "eager_task_factory", None)

else:

    def shielded(cleanup: Callable[[Unpack[Ts]], T], /, *args: Unpack[Ts]) -> T:
        """``cleanup(*args)``: sync code is not cancelled midway."""
        return cleanup(*args)
