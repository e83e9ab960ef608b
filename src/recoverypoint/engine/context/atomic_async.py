"""What an atomic phase receives: its transaction, next to its state and staged jobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy.ext.asyncio as sa_async
from psycopg import sql

from ...observe import NO_OBSERVER, Observer
from .. import phase_guard
from .._pg_async import AsyncTransaction
from .common import KeyIdentity, Staging

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

if True:  # ASYNC

    class _Connection(sa_async.AsyncConnection):
        """SQLAlchemy's AsyncConnection with room for :func:`phase_guard.refusing_to_end`'s
        attributes (SQLAlchemy's own has ``__slots__``)."""


class AsyncAtomicContext(Staging):
    """Handed to an atomic phase; everything it touches commits together or not at all.

    Run SQL with :meth:`execute` (psycopg, the fast path) or through :attr:`connection` and
    :attr:`session` (SQLAlchemy, made on first use); all three share the phase's one
    SERIALIZABLE transaction, which only the engine commits. ``state``, ``key_id`` and
    :meth:`stage_job` are those of every atomic phase (see :class:`Staging`).
    """

    def __init__(
        self,
        tx: AsyncTransaction,
        state: dict[str, Any],
        identity: KeyIdentity,
        point: str,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        super().__init__(state, identity, point, observer)
        self._tx = tx
        self._session: AsyncSession | None = None
        self._connection: sa_async.AsyncConnection | None = None

    async def execute(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> psycopg.AsyncCursor[Any]:
        """Run ``query`` in the phase's transaction with psycopg's placeholders (``%s``,
        ``%(name)s``) and return its cursor; psycopg prepares the statements run often::

            cursor = await tx.execute(
                "INSERT INTO rides (origin) VALUES (%(origin)s) RETURNING id", params
            )
            ride_id = (await cursor.fetchone())[0]
        """
        return await self._tx.execute(query, params)  # type: ignore[arg-type]

    async def scalar(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> Any:
        """The first column of the first row :meth:`execute` returns; ``None`` without rows."""
        cursor = await self.execute(query, params)
        row = await cursor.fetchone()
        return None if row is None else row[0]

    def cursor(self) -> psycopg.AsyncCursor[Any]:
        """A psycopg cursor in the phase's transaction, for ``executemany``, ``copy``…
        (what would end the transaction raises :class:`~recoverypoint.TransactionEnded`)."""
        return self._tx.connection.cursor()

    @property
    def connection(self) -> sa_async.AsyncConnection:
        """A SQLAlchemy Connection in the phase's transaction (made on first use). Its
        ``commit()`` and ``rollback()`` raise :class:`~recoverypoint.TransactionEnded`."""
        if self._connection is None:
            if True:  # ASYNC
                made = _Connection(self._tx.db, self._tx.sqlalchemy())
            else:
                made = self._tx.sqlalchemy()
            self._connection = phase_guard.refusing_to_end(made)
        return self._connection

    @property
    def session(self) -> AsyncSession:
        """An ORM Session joined to the phase's transaction (made on first use).

        Its ``commit()`` does not end the phase's transaction; the engine commits once the
        phase returns.
        """
        if self._session is None:
            # Imported here for the sync twin generated from this module: there, the ORM is a
            # tenth of a second of a process's start, which phases without a session skip.
            from sqlalchemy.ext.asyncio import AsyncSession

            self._session = AsyncSession(bind=self.connection)
        return self._session

    async def close(self) -> None:
        """Flush ORM changes into the transaction before the engine commits it."""
        if self._session is not None:
            await self._session.flush()
            await self._session.close()
