"""The engine's own statements on libpq, through psycopg's ``pq`` module.

Each :class:`~recoverypoint.engine.sql.Statement` is prepared once per connection (sent unnamed
behind a pooler, :mod:`recoverypoint._pooler`), BEGIN, the transaction's token and COMMIT
among them; a transaction's first statement travels in one pipeline with its BEGIN, and the
write that records a phase with its COMMIT (that write raises when it misses its row, which
aborts the transaction before COMMIT runs). A psycopg cursor costs about as much client
CPU again as the round trip it sends (benchmarks/README.md, "Round trips or CPU").

The pipeline is written once, as a conversation that says what it waits for
(:func:`pipeline`): the sync engine waits here, on poll() without the GIL; the async engine
on the event loop (:mod:`recoverypoint.engine._libpq_async`).

Values go as text, the types the statement's own text gives them (a cast, or the column a
value is compared with); rows come back as text, for the caller to read.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from uuid import UUID

import psycopg
from psycopg import pq
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.waiting import Ready, Wait

from .._pooler import UNPREPARED
from . import sql

# Where a pooled connection keeps the names of the statements prepared on it: the
# SQLAlchemy pool's per-connection dict, which lives and dies with the connection.
PREPARED = "recoverypoint_prepared"

Row = tuple[str | None, ...]
T = TypeVar("T")


def execute(
    pooled: Any,
    connection: psycopg.Connection[Any],
    statement: sql.Statement,
    params: Mapping[str, Any],
    *,
    begin: str | None = None,
    commit: bool = False,
) -> Row | None:
    """Run ``statement``, after BEGIN and before COMMIT when asked, in one round trip; its
    first row. Raises the error of the first command that failed. ``begin``: the token of
    the transaction to begin (:func:`recoverypoint.engine.sql.mark`), if one is to begin.

    psycopg deallocates every prepared statement of a connection, the engine's too, after a
    ROLLBACK or DDL it sends, for whatever code shares the connection (so do ``DISCARD ALL``
    and ``DEALLOCATE ALL``). A statement found gone before anything else ran in its
    transaction is prepared again and sent again; one found gone behind other statements of
    its transaction raises :class:`Deallocated`, and the transaction runs again."""
    encoding = client_encoding(connection)
    values = text_values(params, statement.names, encoding)
    try:
        result = _run(pooled, connection, statement, values, begin, commit)
    except psycopg.errors.InvalidSqlStatementName:
        forget(pooled)
        if begin is not None:
            connection.pgconn.exec_(b"ROLLBACK")  # through libpq: psycopg's would deallocate
        elif connection.pgconn.transaction_status != TransactionStatus.IDLE:
            raise Deallocated() from None
        result = _run(pooled, connection, statement, values, begin, commit)
    return first_row(result, encoding)


def client_encoding(connection: psycopg.BaseConnection[Any]) -> str:
    """The connection's client encoding, as Python names it: read from libpq each time (a
    SET may change it), and psycopg's own lookup only for an encoding other than UTF-8,
    as it costs as much as the encoding of a statement's values."""
    if connection.pgconn.parameter_status(b"client_encoding") == b"UTF8":
        return "utf-8"
    return connection.info.encoding


class Deallocated(Exception):
    """The engine's prepared statements were gone in the middle of a transaction, which
    failed with them: it runs again (:func:`recoverypoint.engine._pg.serializable`), and its
    statements are prepared again."""


def forget(pooled: Any) -> None:
    """Have every statement prepared again on ``pooled`` before its next use."""
    pooled.info.pop(PREPARED, None)


def _run(
    pooled: Any,
    connection: psycopg.Connection[Any],
    statement: sql.Statement,
    values: list[bytes],
    begin: str | None,
    commit: bool,
) -> Any:
    if begin is not None or commit:

        def named(command: sql.Statement) -> tuple[bytes | None, bool]:
            return _prepared(pooled, connection, command), False  # prepared before

        return _pipelined(connection, transaction(statement, values, begin, commit, named))
    name = _prepared(pooled, connection, statement)
    pgconn = connection.pgconn
    if name is None:
        return checked(connection, pgconn.exec_params(statement.positional, values))
    return checked(connection, pgconn.exec_prepared(name, values))


def _pipelined(connection: psycopg.Connection[Any], commands: Commands) -> Any:
    exchange = pipeline(connection.pgconn, commands)
    try:
        return answer(connection, _drive(connection.pgconn, exchange))
    finally:
        exchange.close()  # interrupted: its pipeline ends (or the connection closes) now
        if connection.pgconn.pipeline_status:
            # Results still pending (an interrupt while waiting for them): the connection
            # cannot be used again, and the pool drops a closed one.
            connection.close()


# A conversation with the server as psycopg's generators hold one: it yields what it waits
# for (readable, writable) and is sent what the socket is ready for, so that the sync engine
# waits on poll() (`_drive`) and the async one on the event loop (`_libpq_async`).
Exchange = Generator[Wait, Ready | int, T]


class Command(NamedTuple):
    """One statement of a pipeline: sent under the ``name`` it is prepared under (prepared
    there first if ``prepare``: a Close of the name, then its Parse; see :func:`_prepare`),
    or unnamed, parsed with this execution, when ``name`` is ``None``."""

    text: bytes
    name: bytes | None
    values: list[bytes] | None
    prepare: bool


class Commands(NamedTuple):
    """A pipeline's statements in order, and the place of the one whose result is asked for."""

    commands: list[Command]
    statement: int


def transaction(
    statement: sql.Statement,
    values: list[bytes],
    begin: str | None,
    commit: bool,
    named: Callable[[sql.Statement], tuple[bytes | None, bool]],
) -> Commands:
    """``statement``, after BEGIN and the transaction's token ``begin`` (see
    :func:`recoverypoint.engine.sql.mark`; the statement's own, if it ``marks``) when one is
    given, and before COMMIT when asked;
    each sent as ``named`` says (the name it goes under, and whether to prepare it first).
    BEGIN first: a Parse may take the snapshot that its isolation level sets, so every other
    statement is parsed after it."""
    commands = []
    if begin is not None:
        name, prepare = named(sql.BEGIN_STATEMENT)
        commands.append(Command(sql.BEGIN, name, None, prepare))
        if not statement.marks:
            name, prepare = named(sql.MARK)
            if name is None:  # unnamed, as a utility statement: parsed, not planned
                commands.append(Command(sql.mark(begin), None, None, False))
            else:
                commands.append(Command(sql.MARK.positional, name, [begin.encode()], prepare))
    name, prepare = named(statement)
    commands.append(Command(statement.positional, name, values, prepare))
    if commit:
        name, prepare = named(sql.COMMIT)
        commands.append(Command(sql.COMMIT.positional, name, None, prepare))
    return Commands(commands, len(commands) - 1 - commit)


def pipeline(pgconn: Any, commands: Commands) -> Exchange[Pipelined]:
    """``commands`` in one pipeline; what came back, for :func:`answer`."""
    pgconn.enter_pipeline_mode()
    try:
        sent, statement = 0, 0  # the results to read; the asked-for one's place among them
        for place, command in enumerate(commands.commands):
            if command.prepare:
                pgconn.send_close_prepared(command.name)
                pgconn.send_prepare(command.name, command.text)
                sent += 2
            if place == commands.statement:
                statement = sent
            if command.name is None:
                pgconn.send_query_params(command.text, command.values)
            else:
                pgconn.send_query_prepared(command.name, command.values)
            sent += 1
        pgconn.pipeline_sync()
        while pgconn.flush():
            if (yield Wait.RW) & Ready.R:
                pgconn.consume_input()
        results: list[Any] = []
        ended = 0  # each command's results end with a None
        while ended < sent:
            result = yield from next_result(pgconn)
            if result is None:
                ended += 1
            else:
                results.append(result)
        synced = yield from next_result(pgconn)
    finally:
        # Fails with results still pending (an interrupt while waiting for them); the
        # caller then closes the connection.
        with contextlib.suppress(psycopg.Error):
            pgconn.exit_pipeline_mode()
    return Pipelined(results, synced, sent, statement)


class Pipelined(NamedTuple):
    """What came back from a :func:`pipeline`."""

    results: list[Any]  # every command's, in order
    synced: Any  # the pipeline's end
    commands: int  # how many were sent
    statement: int  # the statement's place among them


def next_result(pgconn: Any) -> Exchange[Any]:
    """The next result, once it has come."""
    while pgconn.is_busy():
        yield Wait.R
        pgconn.consume_input()
    return pgconn.get_result()


def answer(connection: Any, pipelined: Pipelined) -> Any:
    """The statement's result out of a :func:`pipeline`'s, or the error of the first
    command that failed."""
    for result in pipelined.results:
        if result.status == ExecStatus.FATAL_ERROR:  # PIPELINE_ABORTED only follows one
            checked(connection, result)
    if len(pipelined.results) != pipelined.commands:
        raise psycopg.OperationalError(
            f"the server sent no result: {connection.pgconn.error_message!r}"
        )
    synced = pipelined.synced
    if synced is None or synced.status != ExecStatus.PIPELINE_SYNC:
        raise psycopg.OperationalError(
            f"the pipeline did not end: {connection.pgconn.error_message!r}"
        )
    return pipelined.results[pipelined.statement]


def _drive(pgconn: Any, exchange: Exchange[T]) -> T:
    """Run ``exchange`` to its end, waiting without the GIL: libpq's own wait would hold it,
    and stall every other thread of the process meanwhile."""
    try:
        waiting = next(exchange)
        while True:
            waiting = exchange.send(_wait(pgconn.socket, waiting))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _command_result(pgconn: Any) -> Any:
    """One command's result, past the None that ends each command's results."""
    result = _next_result(pgconn)
    while _next_result(pgconn) is not None:
        pass
    return result


def last_result(pgconn: Any) -> Exchange[Any]:
    """The last result of a query sent, once all have come; the first error instead, if
    one failed (libpq reads no further)."""
    while pgconn.flush():
        if (yield Wait.RW) & Ready.R:
            pgconn.consume_input()
    last = None
    while (result := (yield from next_result(pgconn))) is not None:
        if last is None or last.status != ExecStatus.FATAL_ERROR:
            last = result
    return last


def command(connection: psycopg.Connection[Any], query: bytes) -> Any:
    """``query`` (one or more statements without parameters) as a simple query; the last
    statement's result, or the error of the one that failed."""
    return checked(connection, connection.pgconn.exec_(query))


def _next_result(pgconn: Any) -> Any:
    return _drive(pgconn, next_result(pgconn))


def _flush(pgconn: Any) -> None:
    while pgconn.flush():
        _wait(pgconn.socket, Wait.W)


def _wait(fileno: int, waiting: Wait) -> Ready:
    # poll(), not select(): a process with a thousand files open has descriptors select()
    # cannot watch.
    poller = select.poll()
    poller.register(fileno, _POLL[waiting])
    events = 0
    for _, event in poller.poll():
        events |= event
    # Readable also when the server hung up: libpq then reads the error.
    readable = Ready.R if events & ~select.POLLOUT else Ready.NONE
    return Ready(readable | (Ready.W if events & select.POLLOUT else Ready.NONE))


_POLL = {
    Wait.R: select.POLLIN,
    Wait.W: select.POLLOUT,
    Wait.RW: select.POLLIN | select.POLLOUT,
}


def _prepared(
    pooled: Any, connection: psycopg.Connection[Any], statement: sql.Statement
) -> bytes | None:
    """The name ``statement`` is prepared under on ``pooled``, preparing it if need be;
    ``None`` behind a pooler, where it is sent unnamed (see :mod:`recoverypoint._pooler`)."""
    info = pooled.info
    if UNPREPARED in info:
        return None
    prepared: set[bytes] = info.setdefault(PREPARED, set())
    if statement.name not in prepared:
        _prepare(connection, statement)
        prepared.add(statement.name)
    return statement.name


def _prepare(connection: psycopg.Connection[Any], statement: sql.Statement) -> None:
    """Prepare ``statement`` under its name, whether the session holds that name or not: a
    PREPARE of a name it holds would fail, and abort the transaction it runs in."""
    pgconn = connection.pgconn
    if CLOSES:
        # A Close of a name never prepared is no error, in a transaction too; and PgBouncer
        # (1.21 on) follows it, where the server's names are PgBouncer's own.
        # Sent and awaited here: libpq's own close_prepared() waits holding the GIL.
        pgconn.send_close_prepared(statement.name)
        _flush(pgconn)
        checked(connection, _command_result(pgconn))
    elif statement.name in _on_server(connection):
        return
    checked(connection, pgconn.prepare(statement.name, statement.positional))


# libpq sends a Close of a prepared statement from version 17 on; before, the engine asks
# the server which of its names it holds.
CLOSES = pq.version() >= 170000 and hasattr(pq.PGconn, "close_prepared")


def _on_server(connection: psycopg.Connection[Any]) -> set[bytes]:
    """The names of the engine's statements prepared on ``connection``'s session."""
    result = checked(connection, connection.pgconn.exec_(_PREPARED_ON_SERVER))
    return {result.get_value(row, 0) for row in range(result.ntuples)}


_PREPARED_ON_SERVER = (
    b"SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'recoverypoint_')"
)


def checked(connection: psycopg.BaseConnection[Any], result: Any) -> Any:
    if result is None:
        raise psycopg.OperationalError(
            f"the server sent no result: {connection.pgconn.error_message!r}"
        )
    if result.status == ExecStatus.FATAL_ERROR:
        raise psycopg.errors.error_from_result(result, encoding=connection.info.encoding)
    return result  # PIPELINE_ABORTED only follows an error raised above


def first_row(result: Any, encoding: str) -> Row | None:
    """The first row of ``result`` as text; ``None`` when it has none."""
    if result.ntuples == 0:
        return None
    # List comprehensions: a generator would be resumed once per column.
    values = [result.get_value(0, column) for column in range(result.nfields)]
    return tuple([None if value is None else value.decode(encoding) for value in values])


def text_values(params: Mapping[str, Any], names: Sequence[str], encoding: str) -> list[bytes]:
    """The values of ``names`` in ``params`` as PostgreSQL's text input reads them. NULLs go
    as None, as psycopg's own cursors send them (pq's hints say bytes only). The types the
    engine sends are told apart in the loop: a call per value cost as much as the rest."""
    values: list[Any] = []
    for name in names:
        value = params[name]
        kind = type(value)
        if kind is list:  # the staged jobs' columns
            value, kind = _array(value), str
        if kind is str:
            if "\x00" in value:
                raise _nul_refused()
            values.append(value.encode(encoding))
        elif value is None:
            values.append(None)
        elif kind is int:
            values.append(str(value).encode())
        elif kind is UUID:
            values.append(value.hex.encode())  # uuid's input reads 32 hex digits
        else:
            values.append(_text(value, encoding))
    return values


def _text(value: Any, encoding: str) -> bytes:
    """A value of any other type the engine sends (or a subclass of one) as text."""
    if isinstance(value, list):
        value = _array(value)
    if isinstance(value, str):
        if "\x00" in value:
            raise _nul_refused()
        return value.encode(encoding)
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, UUID):
        return value.hex.encode()
    if isinstance(value, int | float):
        return str(value).encode()
    raise TypeError(f"no text form for a {type(value).__name__} parameter")


def _nul_refused() -> psycopg.DataError:
    # libpq reads a text value up to its first NUL: refused, as psycopg does.
    return psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")


def _array(items: list[str | None]) -> str:
    """A text[] literal: every element quoted, backslashes and quotes escaped."""
    quoted = [
        "NULL" if item is None else '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for item in items
    ]
    return "{" + ",".join(quoted) + "}"
