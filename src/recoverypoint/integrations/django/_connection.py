"""The engine on Django's own connection: a phase's ORM writes commit with its recovery point.

:func:`django_engine` makes an :class:`~recoverypoint.Engine` whose SQLAlchemy pool owns no
connection: each checkout is the calling thread's Django connection (``connections[using]``,
the psycopg 3 connection Django made, its settings, adapters and time zone included), and
each checkin hands it back to Django open. The engine borrows a connection for exactly one
of its transactions, so while a phase runs its ``BEGIN ISOLATION LEVEL SERIALIZABLE`` is
open on the very connection the ORM uses: ``Ride.objects.create(...)`` in an atomic phase
is a statement of the phase's transaction, and commits with the recovery point and the
staged jobs, or not at all.

Why this, and not the ORM on the engine's connection: Django configures each connection it
makes (its cursor class, its loaders for ``jsonb`` and ``timestamptz``, the time zone, the
role); a connection of another pool handed to the ORM would read rows differently. Django's
own connection keeps every model reading and writing as it does anywhere else; the engine
needs nothing of a connection but psycopg 3, and sends its own BEGIN and COMMIT through libpq.

While the engine holds the connection, Django is told it is in a transaction it does not
manage (``autocommit`` off, as after ``transaction.set_autocommit(False)``; psycopg's too, as on a
connection of a pool of the engine's own), so that what
the ORM does in a phase stays inside the phase's transaction:

- ``transaction.atomic()`` (and what uses it: ``get_or_create``, multi-table ``save``,
  cascading ``delete``) makes a savepoint, which rolls back part of the phase and never
  commits it;
- ``transaction.on_commit()`` raises ``TransactionManagementError``: work that follows a
  commit is a staged job (``tx.stage_job``), committed with the phase;
- what would end the phase's transaction raises :class:`~recoverypoint.TransactionEnded`
  before anything is sent: ``transaction.commit()``, ``.rollback()`` and
  ``.set_autocommit()`` (the connection's own methods, shadowed while the engine holds it),
  ``atomic(durable=True)``, which would be a savepoint that commits nothing (:class:`_Phase`),
  and a statement that ends a transaction, through the ORM's cursors or psycopg's connection
  under them (see phase_guard).

So the engine refuses to run inside ``transaction.atomic()`` (``ATOMIC_REQUESTS`` wraps every
view in one): its COMMIT would commit the caller's block. The view decorators of
:mod:`recoverypoint.integrations.django` mark their views ``non_atomic_requests``.

Connections are per thread in Django, and so they are here: an async view reaches the
engine through ``sync_to_async``, on the thread that holds its connection.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from django.db import connections  # type: ignore[import-untyped]
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.types.json import JsonbLoader
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.pool import ConnectionPoolEntry, Pool

from ...engine import Engine, phase_guard
from ...errors import ConfigurationError

__all__ = ["django_engine"]


def django_engine(using: str = "default", **options: Any) -> Engine:
    """An :class:`~recoverypoint.Engine` on Django's database ``using``, whose transactions
    run on Django's own connection of the calling thread; ``options`` are the Engine's
    (``jobs=``, ``observer=``, ``max_params_bytes=``...).

    The database must be PostgreSQL through psycopg 3 (Django's ``postgresql`` backend with
    ``psycopg`` installed). Make it once, at import time (``myproject/idempotency.py``):
    Django's settings are read at its first transaction.
    """
    if using not in connections.settings:
        raise ConfigurationError(
            f"django_engine(using={using!r}): DATABASES has no such alias; "
            f"it has {', '.join(sorted(connections.settings))}"
        )
    db = sa.create_engine(
        sa.URL.create(f"postgresql+{_DIALECT}", query={"using": using}),
        pool=_DjangoConnections(using),
        # Django registers its own adapters on its connections; leave them as they are.
        use_native_hstore=False,
    )
    return Engine(db, **options)


class _DjangoDialect(PGDialect_psycopg):
    """psycopg's dialect, whose connection arguments are Django's for the alias in the
    URL: for the connections the engine opens outside its pool (a duplicate's wait on
    a connection of its own), which must reach the database Django's connection is on."""

    supports_statement_cache = True  # compiles as psycopg's own does

    def create_connect_args(self, url: sa.URL) -> Any:
        params = connections[url.query["using"]].get_connection_params()
        # How Django's cursors read rows; the engine's own connection needs psycopg's.
        params.pop("cursor_factory", None)
        params.pop("context", None)
        return [], params


_DIALECT = "recoverypoint_django"
registry.register(f"postgresql.{_DIALECT}", __name__, _DjangoDialect.__name__)


# Kept on a Django connection while the engine holds it: how Django had it set up.
_HELD = "_recoverypoint_held"


@dataclass(frozen=True)
class _Held:
    autocommit: bool
    jsonb_loader: type[Loader]  # Django's: jsonb as text, which its JSONField decodes


class _DjangoConnections(Pool):
    """A pool of no connections of its own: each checkout is the calling thread's Django
    connection of ``using``, and a checkin leaves it open, Django's to close."""

    def __init__(self, using: str, **kwargs: Any) -> None:
        super().__init__(self._connect, **kwargs)
        self.using = using
        # One record per Django connection, kept as long as it: the engine keeps the names
        # of the statements it prepared on a connection in its record.
        self._records: weakref.WeakKeyDictionary[Any, ConnectionPoolEntry] = (
            weakref.WeakKeyDictionary()
        )

    def _connect(self) -> Any:  # a psycopg.Connection, which SQLAlchemy's types do not name
        wrapper = connections[self.using]
        if wrapper.connection is not None and wrapper.connection.closed:
            # Lost (a restart, a failover) under the engine or under Django, which keeps a
            # closed connection until a request ends: a worker's thread has no request.
            wrapper.close()
        wrapper.ensure_connection()
        raw = wrapper.connection
        if not isinstance(raw, psycopg.Connection):
            raise ConfigurationError(
                f"DATABASES[{self.using!r}] runs on {type(raw).__module__}; recoverypoint "
                "needs PostgreSQL through psycopg 3: pip install 'psycopg[binary]'"
            )
        return raw

    def _do_get(self) -> ConnectionPoolEntry:
        wrapper = connections[self.using]
        if _HELD in wrapper.__dict__:
            raise ConfigurationError(
                "the engine already holds this thread's Django connection: an engine call "
                "inside a phase (run it from the view, or stage a job)"
            )
        if wrapper.in_atomic_block or (wrapper.connection is not None and not wrapper.autocommit):
            raise ConfigurationError(
                "recoverypoint commits each phase with its recovery point, so it cannot run "
                "inside transaction.atomic() or with autocommit off: with ATOMIC_REQUESTS, "
                "mark the view @transaction.non_atomic_requests (recoverypoint's decorators do)"
            )
        raw = self._connect()
        record = self._records.get(wrapper)
        if (
            record is not None
            and record.dbapi_connection is raw
            and getattr(record, "starttime", 0.0) < self._invalidate_time
        ):
            # An outage met on another thread's connection: this one, as old, is made anew
            # too (SQLAlchemy would, on checkout; here Django makes it).
            wrapper.close()
            raw = self._connect()
        if record is None or record.dbapi_connection is not raw:
            record = self._create_connection()  # calls _connect: the same connection
            self._records[wrapper] = record
        jsonb = raw.adapters.types["jsonb"].oid
        held = _Held(wrapper.autocommit, raw.adapters.get_loader(jsonb, Format.TEXT))
        # While the engine holds it: out of autocommit, as a connection of a pool of its own
        # would be (the workers' queries through SQLAlchemy run in transactions), and for
        # Django a transaction it does not manage.
        raw.autocommit = False
        wrapper.__dict__[_HELD] = held
        wrapper.autocommit = False
        # The engine's queries, the workers' and phase code's read jsonb as psycopg does;
        # Django's cursors get Django's loader back as they execute (_django_loaders).
        raw.adapters.register_loader(jsonb, JsonbLoader)
        wrapper.execute_wrappers.append(_django_loaders)
        phase_guard.shadow(wrapper, _ENDING_METHODS)
        wrapper.atomic_blocks.append(_PHASE)
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        wrapper = connections[self.using]
        held: _Held = wrapper.__dict__.pop(_HELD)
        wrapper.execute_wrappers.remove(_django_loaders)
        phase_guard.unshadow(wrapper, _ENDING_METHODS)
        if _PHASE in wrapper.atomic_blocks:  # gone if phase code made Django connect anew
            wrapper.atomic_blocks.remove(_PHASE)
        wrapper.autocommit = held.autocommit
        wrapper.needs_rollback = False
        raw = wrapper.connection
        if record.dbapi_connection is None or raw.closed:
            # The engine found it broken and dropped it: Django connects anew next time.
            wrapper.close()
        else:
            raw.autocommit = held.autocommit  # idle: the engine's work is over
            raw.adapters.register_loader(raw.adapters.types["jsonb"].oid, held.jsonb_loader)

    def status(self) -> str:
        return f"Django's connection {self.using!r} of each thread"

    def recreate(self) -> _DjangoConnections:
        return _DjangoConnections(self.using, dialect=self._dialect, _dispatch=self.dispatch)

    def dispose(self) -> None:
        """Nothing to close: the connections are Django's."""


class _Phase:
    """The atomic block that Django's ``atomic()`` nests in while the engine holds the
    connection (first in ``atomic_blocks``). Django reads ``_from_testcase`` of the
    innermost block only when ``atomic(durable=True)`` is entered, to let a test case's
    block hold a durable one; in a phase, the durable block would be a savepoint that
    commits nothing, so it is refused. (Nested in phase code's own ``atomic()``, Django
    refuses it itself: ``RuntimeError``.)"""

    @property
    def _from_testcase(self) -> bool:
        phase_guard.refuse()


_PHASE = _Phase()

# Django's connection's methods that would end the engine's transaction.
_ENDING_METHODS = (*phase_guard.ENDING_METHODS, "set_autocommit")


def _django_loaders(
    execute: Any, sql: Any, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """Django's statements while the engine holds its connection read jsonb as Django
    reads it (the engine's read it as psycopg does)."""
    wrapper = context["connection"]
    adapters = context["cursor"].cursor.adapters
    adapters.register_loader(adapters.types["jsonb"].oid, wrapper.__dict__[_HELD].jsonb_loader)
    return execute(sql, params, many, context)
