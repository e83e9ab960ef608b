"""Waiting for a pooled connection on the event loop, its socket registered once.

psycopg's own wait (``AsyncConnection.wait``) registers the socket with the loop, arms a
timer, and takes both away again at every round trip: on asyncio, two system calls, a
timer and a second trip through the loop per round trip; on uvloop, a poll handle made and
closed as well. That was most of what a request cost beyond asyncpg's
(benchmarks/README.md, "AsyncEngine against asyncpg"). A :class:`Waiter` keeps the socket
registered from the engine's first borrow of the connection on a loop until the connection
closes, as asyncpg keeps its own: a round trip costs one future, and a borrow nothing
(registered and let go at every borrow, a replay cost a tenth more client CPU; see
benchmarks/README.md, "The socket registered once per connection").

The waiter stands in for the connection's ``wait``, which psycopg's own code (a cursor, a
COMMIT, SQLAlchemy's adapter and pool) and the engine's pipelines all wait through, and for
its ``close``: a socket closed while registered would leave the loop watching a number the
next connection may get. The pool closes the connections it drops through that ``close``;
libpq itself closes the socket when it finds the connection lost, always inside a call
made here, so the waiter lets the socket go in that same call. A connection nobody closes
(its engine dropped without ``dispose()``) is collected as before: the loop holds the
waiter weakly, and the waiter lets the socket go before libpq closes it. Only the waiter's
loop touches what that loop watches: a close, or a collection, on another thread hands the
socket and the connection to that loop to close.

Between borrows the socket rests in the pool, registered; what wakes the loop then (a
notice, the server going away) wakes it twice at most: the socket rests unregistered
until the next wait. A loop may also stop watching a socket without a word: libuv (uvloop)
does when the socket reports an error, once it has called the reader a last time, and that
call may come while no wait is pending. So, as psycopg's wait looks again on its timer,
while waits are pending the waiter looks at the socket itself every :data:`LOOK` seconds,
and registers it again when it finds it readable.

A connection borrowed on another loop once the waiter's has stopped (``asyncio.run`` again,
with the same engine) gets a waiter of the new loop. A pool shared by loops that run at
once, in several threads, is what SQLAlchemy asks not to do: there a wait on another loop
than the waiter's is psycopg's own, and the waiter's loop is handed the socket to let go.
One gap is left: a connection the server drops during that first wait, while the waiter's
loop is held up, is closed by libpq before that loop lets its socket go.

The waiter stands in for a method below psycopg's documented surface, so it does only where
the psycopg it runs on has the ``wait`` it knows (:func:`fits`: a coroutine taking the
exchange, and ``interval`` or ``timeout`` at most, as psycopg 3.2 and 3.3 have it); on any
other, psycopg's own wait serves, slower but right.

What psycopg's wait does beyond waiting stays psycopg's: an interrupted wait (a cancelled
task) lets the socket go and hands the rest of the conversation to psycopg's own wait,
which cancels the statement on the server; so does a wait with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import select
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import psycopg
from psycopg.abc import PQGen
from psycopg.pq import ConnStatus
from psycopg.waiting import Ready, Wait

RV = TypeVar("RV")

LOOK = 0.1  # seconds between two looks at a socket waited for: psycopg's own interval


class Waiter:
    """Waits for ``connection`` on the loop it was made on, until :meth:`let_go`."""

    __slots__ = (
        "__weakref__",
        "connection",
        "look",
        "looked",
        "loop",
        "registered",
        "socket",
        "unwatched",
        "waiting",
    )

    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.socket: int | None = None  # the socket once registered; None once let go
        self.registered = False
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        socket = connection.pgconn.socket
        self.waiting: asyncio.Future[None] | None = None
        self.unwatched = 0  # wakes in a row with nobody waiting
        self.looked = False  # the look woke the wait: what woke it may not be the socket
        self.look: asyncio.TimerHandle | None = None  # armed while waits are pending
        self.loop.add_reader(socket, _reader, weakref.ref(self))
        self.socket, self.registered = socket, True
        # On the instance: they shadow psycopg's methods while this waiter serves.
        connection.wait = self.wait  # type: ignore[method-assign]
        connection.close = self.close  # type: ignore[method-assign]

    def let_go(self) -> None:
        """The socket unregistered and the connection's own methods back; again is nothing.
        Only on the waiter's loop, or while that loop does not run: what a running loop
        watches is for its own thread to change."""
        if self.socket is None:
            return
        self._unregister()
        del self.connection.wait, self.connection.close

    def _unregister(self) -> None:
        assert self.socket is not None
        if self.registered:
            self.loop.remove_reader(self.socket)
        if self.look is not None:
            self.look.cancel()
        self.socket = None

    def elsewhere(self) -> bool:
        """Whether the waiter's loop runs, in another thread than this one."""
        return self.loop.is_running() and self.loop is not asyncio._get_running_loop()

    async def close(self) -> None:
        """The connection's ``close``, once the loop no longer watches its socket: where
        that loop runs in another thread, by that loop (closed here, the socket's number
        could go to a new socket that loop would then not watch)."""
        if self.elsewhere() and self._on_own_loop(self._close_there):
            return
        self.let_go()
        await _psycopgs_close(self.connection)

    def _close_there(self) -> None:
        self.let_go()
        self.loop.create_task(_psycopgs_close(self.connection))

    def _on_own_loop(self, work: Callable[[], object]) -> bool:
        """``work`` handed to the waiter's loop; ``False`` if it closed meanwhile (and
        watches nothing)."""
        try:
            self.loop.call_soon_threadsafe(work)
        except RuntimeError:
            return False
        return True

    def __del__(self) -> None:
        # Collected with the connection, which the pool dropped without closing it: the
        # socket leaves the loop before libpq closes it. Where the loop runs in another
        # thread, the loop does both (which keeps them till then).
        if self.socket is None or self.loop.is_closed():
            return
        if not (self.elsewhere() and self._on_own_loop(self._close_there)):
            self._unregister()

    async def wait(self, gen: PQGen[RV], interval: float = 0.0, timeout: float | None = None) -> RV:
        """The connection's ``wait``: ``gen``, an exchange with the server, driven to its
        end, waiting on the loop whenever it would block. ``interval`` is psycopg's, for a
        wait that could not be interrupted otherwise; a task is cancelled instead."""
        socket = self.socket
        if asyncio.get_running_loop() is not self.loop:
            # A pool shared by loops (which SQLAlchemy asks not to do): the waiter's loop
            # lets the socket go, and psycopg's own wait serves here.
            if not (self.elsewhere() and self._on_own_loop(self.let_go)):
                self.let_go()
            return await _psycopgs_wait(self.connection, gen, timeout)
        if timeout is not None or socket is None:
            self.let_go()
            return await _psycopgs_wait(self.connection, gen, timeout)
        pgconn = self.connection.pgconn
        try:
            state = next(gen)
            while True:
                writing = state & Wait.W
                ready = _ready_now(socket, state) if writing else Ready.NONE
                if not ready:
                    self.unwatched = 0
                    if not self.registered:  # resting since a wake nobody asked for
                        self._register_again(socket)
                    woken = self.waiting = self.loop.create_future()
                    if self.look is None:
                        self.look = self.loop.call_later(LOOK, self._look)
                    if writing:  # the socket's buffer is full: seldom, and only until it drains
                        self.loop.add_writer(socket, _wake, woken)
                    interruption: BaseException | None = None
                    try:
                        await woken
                    except BaseException as exc:  # a cancelled task, most often
                        interruption = exc
                    self.waiting = None
                    if writing:
                        self.loop.remove_writer(socket)
                    if interruption is not None:
                        return await self._hand_over(gen, state, interruption)
                    if self.looked:
                        self.looked = False
                        ready = _ready_now(socket, state)
                        if ready & Ready.R:  # and the loop said nothing: it may have stopped
                            self._register_again(socket)  # watching (so may a writer's end)
                    else:
                        ready = _ready_now(socket, state) if writing else Ready.R
                state = gen.send(ready)
                if pgconn.status == ConnStatus.BAD:  # libpq closed the socket: nothing to wait on
                    raise psycopg.OperationalError(_lost(pgconn))
        except StopIteration as done:
            return cast(RV, done.value)
        finally:
            if pgconn.status == ConnStatus.BAD:
                self.let_go()

    def _readable(self) -> None:
        if self.waiting is not None:
            _wake(self.waiting)
            return
        # Nobody waits. Once is a wake the loop had queued before the wait it was for
        # read the socket; twice in a row, something nobody asked for (a notice, the
        # server going away): the socket rests until the next wait, or it would wake the
        # loop at every turn.
        self.unwatched += 1
        if self.unwatched > 1:
            assert self.socket is not None  # registered
            self.loop.remove_reader(self.socket)
            self.registered = False

    def _look(self) -> None:
        if self.waiting is None:  # nothing to look for: the next wait arms the look again
            self.look = None
            return
        self.look = self.loop.call_later(LOOK, self._look)
        self.looked = True
        _wake(self.waiting)

    def _register_again(self, socket: int) -> None:
        """The socket watched by the loop again: after a rest, or after the loop may have
        stopped watching it (a registration it holds is replaced, not added to)."""
        if self.registered:
            self.loop.remove_reader(socket)
        self.loop.add_reader(socket, _reader, weakref.ref(self))
        self.registered = True

    async def _hand_over(self, exchange: PQGen[RV], state: Wait, interruption: BaseException) -> RV:
        """The rest of ``exchange`` to psycopg's own wait, ``interruption`` raised at its
        first step: psycopg then cancels the statement on the server, waits for the
        exchange to end, and raises the interruption."""
        self.let_go()
        resumed = cast(PQGen[RV], _Resumed(exchange, state, interruption))
        return await _psycopgs_wait(self.connection, resumed, None)


async def _psycopgs_close(connection: psycopg.AsyncConnection[Any]) -> None:
    """psycopg's own close, whatever stands in for it on the instance."""
    await type(connection).close(connection)


async def _psycopgs_wait(
    connection: psycopg.AsyncConnection[Any], gen: PQGen[RV], timeout: float | None
) -> RV:
    """psycopg's own wait, whatever stands in for it on the instance."""
    own = type(connection).wait
    if timeout is None:  # psycopg 3.2's own wait takes no timeout
        return await own(connection, gen)
    return await own(connection, gen, timeout=timeout)


def _reader(waiter: weakref.ref[Waiter]) -> None:
    """What the loop calls when the socket is readable. It holds the waiter weakly: a
    connection the pool drops without closing it is collected, not kept by the loop."""
    alive = waiter()
    if alive is not None:
        alive._readable()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class _Resumed:
    """An exchange taken over midway: its first step raises the interruption that stopped
    it; the next ones go on from the state it was waiting in."""

    __slots__ = ("exchange", "interruption", "state")

    def __init__(self, exchange: PQGen[Any], state: Wait, interruption: BaseException):
        self.exchange = exchange
        self.state = state
        self.interruption: BaseException | None = interruption

    def __iter__(self) -> _Resumed:
        return self

    def __next__(self) -> Wait:
        interruption, self.interruption = self.interruption, None
        if interruption is not None:
            raise interruption
        return self.state

    def send(self, ready: Ready) -> Wait:
        return self.exchange.send(ready)


def _ready_now(socket: int, state: int) -> int:
    """What ``socket`` is ready for now, of what ``state`` waits for, without a timeout: a
    socket asked for writing nearly always is, and a look is cheaper than a trip through
    the loop; the look of :meth:`Waiter._look` asks here too. poll(), not select(): a
    process with a thousand files open has descriptors select() cannot watch."""
    poller = select.poll()
    poller.register(socket, (_IN if state & Wait.R else 0) | (_OUT if state & Wait.W else 0))
    events = 0
    for _, event in poller.poll(0):
        events |= event
    # An error or a hang-up answers either way, as select() would: libpq then reads it.
    readable = Ready.R if state & Wait.R and events & ~_OUT else Ready.NONE
    return readable | (Ready.W if state & Wait.W and events & ~_IN else Ready.NONE)


_IN, _OUT = select.POLLIN, select.POLLOUT


def _lost(pgconn: Any) -> str:
    message: bytes = pgconn.error_message
    return message.decode(errors="replace").strip() or "the connection to the server was lost"


def fits(connection_class: type) -> bool:
    """Whether :meth:`Waiter.wait` can stand in for ``connection_class``'s ``wait``: a
    coroutine whose parameters it takes all of, in a psycopg whose ``Ready`` and ``Wait``
    have the members the waiter uses (psycopg 3.1 has no ``Ready.NONE``). A psycopg that
    waits otherwise (a new parameter its own code would pass) keeps its own wait."""
    if not all(hasattr(Ready, name) for name in ("NONE", "R", "W")):
        return False
    if not all(hasattr(Wait, name) for name in ("R", "W", "RW")):
        return False
    wait = getattr(connection_class, "wait", None)
    if not inspect.iscoroutinefunction(wait):
        return False
    try:
        parameters = list(inspect.signature(wait).parameters)
    except (TypeError, ValueError):  # a signature Python cannot read
        return False
    return parameters[:2] == ["self", "gen"] and set(parameters[2:]) <= {"interval", "timeout"}


FITS = fits(psycopg.AsyncConnection)


def attach(connection: psycopg.AsyncConnection[Any]) -> None:
    """A :class:`Waiter` for ``connection`` on the running loop, kept until the connection
    closes (or is borrowed on a new loop once its own has stopped), on any loop that watches
    sockets (asyncio's own, uvloop) and a psycopg whose wait it :func:`fits`; psycopg's own
    wait elsewhere. A borrow on the loop of the waiter it has costs a look at it."""
    waiter = getattr(vars(connection).get("wait"), "__self__", None)
    if isinstance(waiter, Waiter):
        if waiter.loop is asyncio.get_running_loop() or waiter.elsewhere():
            return  # the waiter's loop: it serves; a loop that runs too: psycopg's wait here
        waiter.let_go()
    if FITS and not connection.closed:
        # A socket already lost: psycopg's own wait says so at the first statement. A loop
        # that cannot watch a socket (asyncio's proactor) raises NotImplementedError.
        with contextlib.suppress(psycopg.OperationalError, NotImplementedError):
            Waiter(connection)
