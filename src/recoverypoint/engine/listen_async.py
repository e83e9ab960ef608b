"""A duplicate's wait for the first call's answer, on a connection of its own (see
:mod:`recoverypoint.engine.waits`).

The connection is opened for the wait and closed after it, outside the engine's pool, in
autocommit: the waiter holds no pooled connection and no transaction, and cannot starve
the calls it waits for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
import sqlalchemy as sa
from psycopg import sql

from .waits import CannotWait


class AsyncKeyListener:
    """LISTENs on one key's channel."""

    def __init__(self, connection: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        self.connection = connection

    async def heard(self, timeout: float) -> bool:
        """Whether a NOTIFY came within ``timeout`` seconds; :class:`CannotWait` if the
        connection failed."""
        try:
            async for _ in self.connection.notifies(timeout=timeout, stop_after=1):
                return True
        except psycopg.Error as exc:
            raise CannotWait() from exc
        return False


@asynccontextmanager
async def listening(db: sa.Engine, channel: str, lock: int) -> AsyncIterator[AsyncKeyListener]:
    """A connection of its own to ``db``'s database, LISTENing on ``channel`` and holding
    the advisory lock ``lock`` shared (until it closes), so that the write that finishes or
    releases the key sends its NOTIFY; a write that took the lock first is waited for.
    :class:`CannotWait` if the connection fails."""
    _, params = db.dialect.create_connect_args(db.url)
    try:
        connection = await psycopg.AsyncConnection.connect(autocommit=True, **params)
    except psycopg.Error as exc:
        raise CannotWait() from exc
    try:
        try:
            await connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            await connection.execute("SELECT pg_advisory_lock_shared(%s)", (lock,))
        except psycopg.Error as exc:
            raise CannotWait() from exc
        yield AsyncKeyListener(connection)
    finally:
        await connection.close()
