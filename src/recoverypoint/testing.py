"""Fault injection at the engine's boundaries, for recoverypoint's tests and for yours.

A fault point is named ``<boundary>:<name>``:

==========================  ===========================================================
``before_commit:<point>``   an atomic phase ran; its transaction has not committed
``after_commit:<point>``    the phase (or a step's result) committed; nothing else ran
``before_foreign:<point>``  a foreign step is about to be called
``after_foreign:<point>``   the foreign step returned; its result is not yet committed
``after_publish:<job>``     the enqueuer published a job; its row is not yet deleted
==========================  ===========================================================

``<name>`` may be ``*`` for every point of that boundary. Each armed point fires with a
probability, and its effect is an exception (:class:`InjectedFault`), an abrupt process
exit (``os._exit``, what SIGKILL or a power cut leaves behind: no ``finally``, no rollback
sent, the database sees the connection drop), or, at a ``before_commit`` point, a
serialization failure (``conflict``: :class:`InjectedConflict`, SQLSTATE 40001), which the
engine rolls back and runs the phase again for, as for PostgreSQL's own, or, at an
``after_commit`` point, a COMMIT whose answer is lost (``lost_answer``:
:class:`InjectedLostAnswer`, a ``psycopg.OperationalError``): committed, and the caller
sees the connection drop.

Switch faults on in code::

    from recoverypoint.testing import faults
    faults.arm("after_commit:ride_created", probability=1.0, effect="raise")

or for a whole process through the environment::

    RECOVERYPOINT_FAULTS="after_commit:ride_created=0.2,before_foreign:charge_created=0.1"
    RECOVERYPOINT_FAULT_EFFECT=exit      # or raise (the default), conflict (before_commit),
                                         # lost_answer (after_commit)
    RECOVERYPOINT_FAULT_SEED=42          # repeatable runs

Faults are off by default; when off, each boundary costs one attribute read. Under pytest,
the ``rp_faults`` fixture (:mod:`recoverypoint.integrations.pytest_plugin`) is this
registry, disarmed before and after each test.

:func:`temporary_database` gives a test (or a demo run) an empty database of its own on a
server you run, and drops it afterwards.

:class:`Clock` moves recoverypoint's time forward, so that a test can say "the lease ran
out", "72 hours later" or "past the provider's window" in one line instead of sleeping
through it::

    clock = Clock(engine)
    clock.advance(hours=72)   # the finished key is past its retention now

Every rule about time is judged on the database's clock (``now()``), never the process's,
and each is a duration since a moment stored in a row (a lease's ``locked_at``, a finished
key's ``finished_at``, a back-off's ``next_attempt_at``, a recovery point's
``point_reached_at``, a deleted key's generation...). Moving every such moment back by the
same amount is, to every rule, the same as the clock moving forward, and the database's
clock is left alone. A live holder's heartbeat renews its lease from the real ``now()``
afterwards, as it would in production once that much time had passed. One thing reads a
clock of its own, and does not move: a running step's
:attr:`~recoverypoint.StepContext.lease_lost`, the time since its last renewal on the
process's monotonic clock: after ``clock.advance`` past ``lock_timeout``, another attempt
may take a running step's key over before its next renewal while its ``lease_lost`` is
still ``False`` (the fence fails its commit with LockLost all the same). Under pytest, the
``rp_clock`` fixture is a :class:`Clock` on the plugin's database.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

# The fault points live beside the engine that consults them; they are the kit's to offer.
from ._faults import (
    BOUNDARIES,
    FAULT_EXIT_STATUS,
    Effect,
    Faults,
    InjectedConflict,
    InjectedFault,
    InjectedLostAnswer,
    faults,
)
from .database import create_engine, normalize_url
from .schema import metadata

__all__ = [
    "BOUNDARIES",
    "FAULT_EXIT_STATUS",
    "Clock",
    "Effect",
    "Faults",
    "InjectedConflict",
    "InjectedFault",
    "InjectedLostAnswer",
    "faults",
    "temporary_database",
]


@contextmanager
def temporary_database(
    server_url: str, prefix: str = "rp_test", *, template: str | None = None
) -> Iterator[str]:
    """Create an empty database ``<prefix>_<hex>`` on the server of ``server_url``, yield
    its URL (``postgresql+psycopg://``, password included), and drop it at the end.

    With ``template``, the name of a database on the same server, the new database is a copy
    of it (``CREATE DATABASE … TEMPLATE``) instead of empty: migrate one database once and
    copy it for each test, which is much quicker than migrating each. Nothing may be
    connected to the template while it is copied.

    The database named in ``server_url`` is only used to create and drop the new one, so
    ``…/postgres`` will do; the role needs the CREATEDB privilege.
    """
    url = normalize_url(server_url)
    name = f"{prefix}_{secrets.token_hex(8)}"
    # CREATE/DROP DATABASE cannot run inside a transaction.
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as connection:
            copied = ""
            if template is not None:
                quoted = connection.dialect.identifier_preparer.quote_identifier(template)
                copied = f" TEMPLATE {quoted}"
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"{copied}')
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                # FORCE: connections left behind (a killed process's) must not keep it.
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


class _HasDatabase(Protocol):
    """An :class:`~recoverypoint.Engine` or :class:`~recoverypoint.AsyncEngine`: each has
    a sync SQLAlchemy engine on its database."""

    @property
    def db(self) -> sa.Engine: ...


# Every moment recoverypoint stores, table by table: the columns a rule about time measures
# from. Read off the schema, so that a column added later moves with the others.
_MOMENTS = [
    (table, [column for column in table.columns if isinstance(column.type, sa.DateTime)])
    for table in metadata.sorted_tables
]


class Clock:
    """recoverypoint's time in a test database, moved forward on demand (see the module's
    docstring for why moving the stored moments back is the same thing).

    ``database``: a SQLAlchemy engine on the database, or the :class:`~recoverypoint.Engine`
    or :class:`~recoverypoint.AsyncEngine` that runs on it. Every key, job and worker record
    of that database moves: give a test that moves time a database of its own (the
    ``rp_database`` fixture's is one per session; keys of other tests move too).
    """

    def __init__(self, database: sa.Engine | _HasDatabase) -> None:
        self._db = database if isinstance(database, sa.Engine) else database.db
        self.moved = timedelta(0)
        """How far this clock has moved time so far."""

    def advance(self, by: timedelta | None = None, **parts: float) -> None:
        """Move time forward by ``by`` or by ``timedelta(**parts)`` (``hours=72``,
        ``seconds=91``...), in one transaction: a concurrent request sees all of its key's
        moments moved, or none."""
        if (by is None) == (not parts):
            raise TypeError("advance() takes a timedelta or timedelta's keywords, not both")
        step = by if by is not None else timedelta(**parts)
        if step < timedelta(0):
            raise ValueError(f"time only moves forward: advance({step!r})")
        with self._db.begin() as conn:
            for table, columns in _MOMENTS:
                if columns:
                    conn.execute(table.update().values({c.name: c - step for c in columns}))
        self.moved += step
