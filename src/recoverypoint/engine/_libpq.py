"""The sync engine's own statements on libpq, through psycopg's ``pq`` module.

Each :class:`~recoverypoint.sql.Statement` is prepared once per connection (sent unnamed
behind a pooler, :mod:`recoverypoint._pooler`); a transaction's
first statement travels in one pipeline with its BEGIN, and the write that records a phase
with its COMMIT (that write raises when it misses its row, which aborts the transaction
before COMMIT runs). A psycopg cursor costs about as much client CPU again as the round
trip it sends (benchmarks/README.md, "Round trips or CPU"); the async engine keeps psycopg's
async cursor, which waits on the event loop where libpq would block it.

Values go as text, the types the statement's own text gives them (a cast, or the column a
value is compared with); rows come back as text, for the caller to read.
"""

from __future__ import annotations

import select
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import pq
from psycopg.pq import ExecStatus, TransactionStatus

from .._pooler import UNPREPARED
from . import sql

# Where a pooled connection keeps the names of the statements prepared on it: the
# SQLAlchemy pool's per-connection dict, which lives and dies with the connection.
_PREPARED = "recoverypoint_prepared"

Row = tuple[str | None, ...]


def execute(
    pooled: Any,
    connection: psycopg.Connection[Any],
    statement: sql.Statement,
    params: Mapping[str, Any],
    *,
    begin: bool = False,
    commit: bool = False,
) -> Row | None:
    """Run ``statement``, after BEGIN and before COMMIT when asked, in one round trip; its
    first row. Raises the error of the first command that failed.

    psycopg deallocates every prepared statement of a connection, the engine's too, after a
    ROLLBACK or DDL it sends, for whatever code shares the connection (so do ``DISCARD ALL``
    and ``DEALLOCATE ALL``). A statement found gone before anything else ran in its
    transaction is prepared again and sent again; one found gone behind other statements of
    its transaction raises :class:`Deallocated`, and the transaction runs again."""
    encoding = _encoding(connection)
    values = _values(params, statement.names, encoding)
    try:
        result = _run(pooled, connection, statement, values, begin, commit)
    except psycopg.errors.InvalidSqlStatementName:
        forget(pooled)
        if begin:
            connection.pgconn.exec_(b"ROLLBACK")  # through libpq: psycopg's would deallocate
        elif connection.pgconn.transaction_status != TransactionStatus.IDLE:
            raise Deallocated() from None
        result = _run(pooled, connection, statement, values, begin, commit)
    return first_row(result, encoding)


def _encoding(connection: psycopg.Connection[Any]) -> str:
    """The connection's client encoding, as Python names it: read from libpq each time (a
    SET may change it), and psycopg's own lookup only for an encoding other than UTF-8,
    as it costs as much as the encoding of a statement's values."""
    if connection.pgconn.parameter_status(b"client_encoding") == b"UTF8":
        return "utf-8"
    return connection.info.encoding


class Deallocated(Exception):
    """The engine's prepared statements were gone in the middle of a transaction, which
    failed with them: it runs again (:func:`recoverypoint._pg.serializable`), and its
    statements are prepared again."""


def forget(pooled: Any) -> None:
    """Have every statement prepared again on ``pooled`` before its next use."""
    pooled.info.pop(_PREPARED, None)


def _run(
    pooled: Any,
    connection: psycopg.Connection[Any],
    statement: sql.Statement,
    values: list[bytes],
    begin: bool,
    commit: bool,
) -> Any:
    name = _prepared(pooled, connection, statement)
    if begin or commit:
        return _pipelined(connection, statement, name, values, begin, commit)
    pgconn = connection.pgconn
    if name is None:
        return _checked(connection, pgconn.exec_params(statement.positional, values))
    return _checked(connection, pgconn.exec_prepared(name, values))


def _pipelined(
    connection: psycopg.Connection[Any],
    statement: sql.Statement,
    name: bytes | None,
    values: list[bytes],
    begin: bool,
    commit: bool,
) -> Any:
    pgconn = connection.pgconn
    pgconn.enter_pipeline_mode()
    try:
        if begin:
            pgconn.send_query_params(sql.BEGIN, None)
        if name is None:  # unnamed: parsed with this execution, in the same round trip
            pgconn.send_query_params(statement.positional, values)
        else:
            pgconn.send_query_prepared(name, values)
        if commit:
            pgconn.send_query_params(b"COMMIT", None)
        pgconn.pipeline_sync()
        _flush(pgconn)
        commands = begin + 1 + commit
        results: list[Any] = []
        ended = 0  # each command's results end with a None
        while ended < commands:
            result = _next_result(pgconn)
            if result is None:
                ended += 1
            else:
                results.append(result)
        synced = _next_result(pgconn)
    finally:
        try:
            pgconn.exit_pipeline_mode()
        except psycopg.Error:
            # Results still pending (an interrupt while waiting for them): the connection
            # cannot be used again, and the pool drops a closed one.
            connection.close()
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:  # PIPELINE_ABORTED only follows one
            _checked(connection, result)
    if len(results) != commands:
        raise psycopg.OperationalError(
            f"the server sent no result: {connection.pgconn.error_message!r}"
        )
    if synced is None or synced.status != ExecStatus.PIPELINE_SYNC:
        raise psycopg.OperationalError(f"the pipeline did not end: {pgconn.error_message!r}")
    return results[begin]


def _command_result(pgconn: Any) -> Any:
    """One command's result, past the None that ends each command's results."""
    result = _next_result(pgconn)
    while _next_result(pgconn) is not None:
        pass
    return result


def _next_result(pgconn: Any) -> Any:
    """The next result, waiting for it without the GIL: libpq's own wait would hold it, and
    stall every other thread of the process meanwhile."""
    while pgconn.is_busy():
        _wait(pgconn.socket, select.POLLIN)
        pgconn.consume_input()
    return pgconn.get_result()


def _flush(pgconn: Any) -> None:
    while pgconn.flush():
        _wait(pgconn.socket, select.POLLOUT)


def _wait(fileno: int, event: int) -> None:
    # poll(), not select(): a process with a thousand files open has descriptors select()
    # cannot watch.
    poller = select.poll()
    poller.register(fileno, event)
    poller.poll()


def _prepared(
    pooled: Any, connection: psycopg.Connection[Any], statement: sql.Statement
) -> bytes | None:
    """The name ``statement`` is prepared under on ``pooled``, preparing it if need be;
    ``None`` behind a pooler, where it is sent unnamed (see :mod:`recoverypoint._pooler`)."""
    info = pooled.info
    if UNPREPARED in info:
        return None
    prepared: set[bytes] = info.setdefault(_PREPARED, set())
    if statement.name not in prepared:
        _prepare(connection, statement)
        prepared.add(statement.name)
    return statement.name


def _prepare(connection: psycopg.Connection[Any], statement: sql.Statement) -> None:
    """Prepare ``statement`` under its name, whether the session holds that name or not: a
    PREPARE of a name it holds would fail, and abort the transaction it runs in."""
    pgconn = connection.pgconn
    if _CLOSES:
        # A Close of a name never prepared is no error, in a transaction too; and PgBouncer
        # (1.21 on) follows it, where the server's names are PgBouncer's own.
        # Sent and awaited here: libpq's own close_prepared() waits holding the GIL.
        pgconn.send_close_prepared(statement.name)
        _flush(pgconn)
        _checked(connection, _command_result(pgconn))
    elif statement.name in _on_server(connection):
        return
    _checked(connection, pgconn.prepare(statement.name, statement.positional))


# libpq sends a Close of a prepared statement from version 17 on; before, the engine asks
# the server which of its names it holds.
_CLOSES = pq.version() >= 170000 and hasattr(pq.PGconn, "close_prepared")


def _on_server(connection: psycopg.Connection[Any]) -> set[bytes]:
    """The names of the engine's statements prepared on ``connection``'s session."""
    result = _checked(connection, connection.pgconn.exec_(_PREPARED_ON_SERVER))
    return {result.get_value(row, 0) for row in range(result.ntuples)}


_PREPARED_ON_SERVER = (
    b"SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'recoverypoint_')"
)


def _checked(connection: psycopg.Connection[Any], result: Any) -> Any:
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


def _values(params: Mapping[str, Any], names: Sequence[str], encoding: str) -> list[bytes]:
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
