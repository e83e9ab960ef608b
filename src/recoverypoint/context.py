"""What a phase receives: the transaction and state of an atomic phase, the keys of a step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from . import phase_guard
from ._pg import Transaction
from .keys import canonical_json, derived_key
from .observe import NO_OBSERVER, Observer


@dataclass(frozen=True)
class KeyIdentity:
    """The stored fields every derived key is built from."""

    operation: str
    key_id: int
    created_at: datetime

    def derive(self, kind: str, *names: str) -> str:
        return derived_key(kind, self.key_id, self.created_at, *names, operation=self.operation)


@dataclass(frozen=True)
class StagedJob:
    name: str
    args_json: str
    job_key: str
    trace_context: str | None = None
    """The W3C traceparent of the phase that staged it, when an observer traces."""


class AtomicContext:
    """Handed to an atomic phase; everything it touches commits together or not at all.

    Run SQL with :meth:`execute` (psycopg, the fast path) or through :attr:`connection` and
    :attr:`session` (SQLAlchemy, made on first use); all three share the phase's one
    SERIALIZABLE transaction, which only the engine commits.

    Attributes
    ----------
    state:
        A mutable dict persisted with the recovery point: what later phases need to know.
    key_id:
        The key record's id, for linking business rows to the request.
    """

    def __init__(
        self,
        tx: Transaction,
        state: dict[str, Any],
        identity: KeyIdentity,
        point: str,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self._tx = tx
        self._observer = observer
        self.state = state
        self.key_id = identity.key_id
        self._identity = identity
        self._point = point
        self._session: Session | None = None
        self._connection: Connection | None = None
        self.staged_jobs: list[StagedJob] = []

    def execute(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> psycopg.Cursor[Any]:
        """Run ``query`` in the phase's transaction with psycopg's placeholders (``%s``,
        ``%(name)s``) and return its cursor; psycopg prepares the statements run often::

            ride_id = tx.execute(
                "INSERT INTO rides (origin) VALUES (%(origin)s) RETURNING id", params
            ).fetchone()[0]
        """
        # Once the transaction ended (a Session's rollback...), a statement would commit
        # on its own in autocommit, without a recovery point.
        phase_guard.check_still_open(self._tx, self._point)
        phase_guard.check_statement(query, self._point)
        return self._tx.execute(query, params)  # type: ignore[arg-type]

    def scalar(
        self, query: str | sql.Composable, params: Mapping[str, Any] | Sequence[Any] | None = None
    ) -> Any:
        """The first column of the first row :meth:`execute` returns; ``None`` without rows."""
        row = self.execute(query, params).fetchone()
        return None if row is None else row[0]

    def cursor(self) -> psycopg.Cursor[Any]:
        """A psycopg cursor in the phase's transaction, for ``executemany``, ``copy``…"""
        return self._tx.connection.cursor()

    @property
    def connection(self) -> Connection:
        """A SQLAlchemy Connection in the phase's transaction (made on first use). Its
        ``commit()`` and ``rollback()`` raise :class:`~recoverypoint.TransactionEnded`."""
        if self._connection is None:
            self._connection = phase_guard.refusing_to_end(self._tx.sqlalchemy(), self._point)
        return self._connection

    @property
    def session(self) -> Session:
        """An ORM Session joined to the phase's transaction (made on first use).

        Its ``commit()`` does not end the phase's transaction; the engine commits once the
        phase returns.
        """
        if self._session is None:
            self._session = Session(bind=self.connection)
        return self._session

    def stage_job(self, name: str, args: Mapping[str, Any] | None = None) -> str:
        """Stage a job in this phase's transaction; the enqueuer publishes it after commit.

        Returns the job's ``job_key``, stable across retries, for the consumer to dedupe on.
        """
        if not name:
            raise ValueError("a job needs a name")
        try:
            args_json = canonical_json(dict(args or {}))
        except ValueError as exc:
            raise ValueError(f"the args of job {name!r} are {exc}") from exc
        job_key = self._identity.derive("job", self._point, str(len(self.staged_jobs)), name)
        trace_context = self._observer.trace_context()  # the consumer's trace links here
        self.staged_jobs.append(StagedJob(name, args_json, job_key, trace_context))
        return job_key

    def close(self) -> None:
        """Flush ORM changes into the transaction before the engine commits it."""
        if self._session is not None:
            self._session.flush()
            self._session.close()


class StepContext:
    """Handed to a foreign step, which runs outside any transaction.

    Attributes
    ----------
    state:
        A read-only view of what earlier phases committed.
    key_id:
        The key record's id.
    """

    def __init__(self, state: Mapping[str, Any], identity: KeyIdentity, point: str) -> None:
        self.state: Mapping[str, Any] = MappingProxyType(dict(state))
        self.key_id = identity.key_id
        self._identity = identity
        self._point = point

    def downstream_key(self, name: str | None = None) -> str:
        """The idempotency key to hand the foreign system for this step.

        The same for every attempt at this step of this request, different for every other
        step and request, at most 67 characters, and free of the scope and the client's key.
        Pass ``name`` when one step makes several foreign calls.
        """
        return self._identity.derive("downstream", self._point, name or "")
