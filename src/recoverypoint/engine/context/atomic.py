# Generated from src/recoverypoint/engine/context/atomic_async.py by tools/async_to_sync.py:
# edit engine/context/atomic_async.py, then run tools/async_to_sync.py.
"""What an atomic phase receives: its transaction, next to its state and staged jobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from ...observe import NO_OBSERVER, Observer
from .. import phase_guard
from .._pg import Transaction
from .common import KeyIdentity, Staging

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


class AtomicContext(Staging):
    """Handed to an atomic phase; everything it touches commits together or not at all.

    Run SQL with :meth:`execute` (psycopg, the fast path) or through :attr:`connection` and
    :attr:`session` (SQLAlchemy, made on first use); all three share the phase's one
    SERIALIZABLE transaction, which only the engine commits. ``state``, ``key_id`` and
    :meth:`stage_job` are those of every atomic phase (see :class:`Staging`).
    """

    def __init__(
        self,
        tx: Transaction,
        state: dict[str, Any],
        identity: KeyIdentity,
        point: str,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        super().__init__(state, identity, point, observer)
        self._tx = tx
        self._session: Session | None = None
        self._connection: sa.Connection | None = None

    def execute(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> psycopg.Cursor[Any]:
        """Run ``query`` in the phase's transaction with psycopg's placeholders (``%s``,
        ``%(name)s``) and return its cursor; psycopg prepares the statements run often::

            cursor = tx.execute(
                "INSERT INTO rides (origin) VALUES (%(origin)s) RETURNING id", params
            )
            ride_id = (cursor.fetchone())[0]
        """
        return self._tx.execute(query, params)  # type: ignore[arg-type]

    def scalar(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> Any:
        """The first column of the first row :meth:`execute` returns; ``None`` without rows."""
        cursor = self.execute(query, params)
        row = cursor.fetchone()
        return None if row is None else row[0]

    def cursor(self) -> psycopg.Cursor[Any]:
        """A psycopg cursor in the phase's transaction, for ``executemany``, ``copy``…
        (what would end the transaction raises :class:`~recoverypoint.TransactionEnded`)."""
        return self._tx.connection.cursor()

    @property
    def connection(self) -> sa.Connection:
        """A SQLAlchemy Connection in the phase's transaction (made on first use). Its
        ``commit()`` and ``rollback()`` raise :class:`~recoverypoint.TransactionEnded`."""
        if self._connection is None:
            made = self._tx.sqlalchemy()
            self._connection = phase_guard.refusing_to_end(made)
        return self._connection

    @property
    def session(self) -> Session:
        """An ORM Session joined to the phase's transaction (made on first use).

        Its ``commit()`` does not end the phase's transaction; the engine commits once the
        phase returns.
        """
        if self._session is None:
            # Imported here for the sync twin generated from this module: there, the ORM is a
            # tenth of a second of a process's start, which phases without a session skip.
            from sqlalchemy.orm import Session

            self._session = Session(bind=self.connection)
        return self._session

    def close(self) -> None:
        """Flush ORM changes into the transaction before the engine commits it."""
        if self._session is not None:
            self._session.flush()
            self._session.close()
