"""The async engine's own statements on libpq, as the sync engine sends them
(:mod:`recoverypoint.engine._libpq`): prepared once per connection, a transaction's first
statement in one pipeline with its BEGIN, the write that records a phase with its COMMIT.
The pipeline is the same conversation (:func:`~recoverypoint.engine._libpq.pipeline`),
waited for on the event loop through the connection's ``wait``: the engine's waiter once
the engine has borrowed the connection on that loop (:mod:`recoverypoint.engine._waiter`),
else psycopg's own;
either cancels the statement on the server when the task is cancelled meanwhile.

A statement is prepared in the pipeline that first runs it (a Close of its name, then its
Parse), so preparing costs no round trip of its own. With a libpq older than 17, which
cannot send a Close, the statements go unnamed, parsed with each execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .._pooler import UNPREPARED
from . import _libpq, sql
from ._libpq import Deallocated, Row, first_row, forget

__all__ = ["Deallocated", "command", "execute", "first_row", "forget"]


async def execute(
    pooled: Any,
    connection: psycopg.AsyncConnection[Any],
    statement: sql.Statement,
    params: Mapping[str, Any],
    *,
    begin: str | None = None,
    commit: bool = False,
    meanwhile: Callable[[], object] | None = None,
) -> Row | None:
    """Run ``statement``, after BEGIN and before COMMIT when asked, in one round trip; its
    first row. As :func:`recoverypoint.engine._libpq.execute`: a statement found
    deallocated is prepared and sent again if nothing ran before it in its transaction,
    else :class:`Deallocated` is raised and the transaction runs again; ``meanwhile`` runs
    while the statement is on its way."""
    encoding = _libpq.client_encoding(connection)
    values = _libpq.text_values(params, statement.names, encoding)
    try:
        result = await _run(pooled, connection, statement, values, begin, commit, meanwhile)
    except psycopg.errors.InvalidSqlStatementName:
        forget(pooled)
        if begin is not None:
            await command(connection, b"ROLLBACK")  # psycopg's own would deallocate
        elif connection.pgconn.transaction_status != TransactionStatus.IDLE:
            raise Deallocated() from None
        result = await _run(pooled, connection, statement, values, begin, commit)
    return first_row(result, encoding)


async def command(connection: psycopg.AsyncConnection[Any], query: bytes) -> Any:
    """``query`` (one or more statements without parameters) as a simple query; the last
    statement's result, or the error of the one that failed."""
    pgconn = connection.pgconn
    pgconn.send_query(query)
    return _libpq.checked(connection, await connection.wait(_libpq.last_result(pgconn)))


async def _run(
    pooled: Any,
    connection: psycopg.AsyncConnection[Any],
    statement: sql.Statement,
    values: list[bytes],
    begin: str | None,
    commit: bool,
    meanwhile: Callable[[], object] | None = None,
) -> Any:
    info = pooled.info
    prepared: set[bytes] | None = None
    if UNPREPARED not in info and _libpq.CLOSES:
        prepared = info.setdefault(_libpq.PREPARED, set())

    def named(command: sql.Statement) -> tuple[bytes | None, bool]:
        if prepared is None:
            return None, False
        return command.name, command.name not in prepared

    if begin is None and not commit:
        name, prepare = named(statement)
        if not prepare:  # a lone statement (a replay's lookup) needs no pipeline
            return await _alone(connection, statement, values, name, meanwhile)
    if meanwhile is not None:  # not yet prepared on the connection: its first run, or after
        meanwhile()  # a rollback made psycopg deallocate the statements
    commands = _libpq.transaction(statement, values, begin, commit, named)
    exchange = _libpq.pipeline(connection.pgconn, commands)
    try:
        result = _libpq.answer(connection, await connection.wait(exchange))
    finally:
        exchange.close()  # interrupted: its pipeline ends (or the connection closes) now
        if connection.pgconn.pipeline_status:
            # Results still pending: the connection cannot be used again, and the pool
            # drops a closed one.
            await connection.close()
    if prepared is not None:
        prepared.update(c.name for c in commands.commands if c.prepare and c.name is not None)
    return result


async def _alone(
    connection: psycopg.AsyncConnection[Any],
    statement: sql.Statement,
    values: list[bytes],
    name: bytes | None,
    meanwhile: Callable[[], object] | None,
) -> Any:
    """``statement`` on its own, by ``name`` if it is prepared under one: sent as one
    query, as :func:`command` sends its own, without entering a pipeline and syncing it
    (a third of a replay's lookup's client CPU on the event loop); ``meanwhile`` runs once
    it is sent."""
    pgconn = connection.pgconn
    if name is None:
        pgconn.send_query_params(statement.positional, values)
    else:
        pgconn.send_query_prepared(name, values)
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            # Its error is the one to raise, once the statement's result is read: the
            # connection goes back to the pool idle (one that cannot is dropped).
            with contextlib.suppress(psycopg.Error):
                await connection.wait(_libpq.last_result(pgconn))
            raise
    return _libpq.checked(connection, await connection.wait(_libpq.last_result(pgconn)))
