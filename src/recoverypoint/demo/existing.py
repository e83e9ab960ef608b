"""The demo in a database its user made (``recoverypoint demo --existing``).

A database the demo creates exists on the server that created it alone: a Citus
coordinator does not create it on its workers. So the demo also runs in a database the
user made (on Citus: on every node, with the extension and the workers added), which may
hold tables of the user's. For the run, the database is:

- refused before anything is written when it does not exist, when it holds a table by
  one of Rocket Rides' names (a run's leftovers, or a table of the user's that the demo
  would write into), or when recoverypoint's tables hold a key or a staged job (the
  checks count every one, so they would count the user's too);
- migrated by the run (:func:`recoverypoint.demo.rocket_rides.schema.migrate`: on a
  Citus coordinator, every table placed as ``recoverypoint migrate --citus`` does);
- emptied of the run afterwards, whatever its outcome: Rocket Rides' tables dropped, and
  the rows the run wrote into recoverypoint's tables deleted. recoverypoint's tables stay,
  migrated (and distributed), as ``recoverypoint migrate`` would have left them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ..database import create_engine
from ..errors import ConfigurationError
from .rocket_rides.receipts import RECEIPT_JOB
from .rocket_rides.schema import TABLES

# The name Rocket Rides gives its operation (.rocket_rides.api, not imported here: FastAPI
# is the demo extra's, and this module is imported with every command).
OPERATION = "create_ride"
_NAMED = sa.text("SELECT EXISTS (SELECT FROM pg_database WHERE datname = :name)")

_PRESENT = sa.text(
    "SELECT t FROM unnest(CAST(:tables AS text[])) AS t WHERE to_regclass(t) IS NOT NULL"
)
# Keys or staged jobs, when recoverypoint's tables exist (none yet in a database not
# migrated): of other operations than the demo's, then of the demo's, which a run cut short
# (killed before it cleaned up) leaves. A query per table: Citus plans no EXISTS of two
# distributed tables in one statement.
_HELD = (
    (
        sa.text("SELECT 1 FROM idempotency_keys WHERE operation <> :operation LIMIT 1"),
        sa.text("SELECT 1 FROM staged_jobs WHERE job_name <> :job LIMIT 1"),
    ),
    (
        sa.text("SELECT 1 FROM idempotency_keys WHERE operation = :operation LIMIT 1"),
        sa.text("SELECT 1 FROM staged_jobs WHERE job_name = :job LIMIT 1"),
    ),
)
# What the run wrote into recoverypoint's tables: its keys, jobs and their records, and
# the rows its workers (on this host, since the run began) recorded their passes in.
_CLEAN = (
    sa.text("DELETE FROM idempotency_keys WHERE operation = :operation"),
    sa.text("DELETE FROM key_generations WHERE operation = :operation"),
    sa.text("DELETE FROM staged_jobs WHERE job_name = :job"),
    sa.text("DELETE FROM processed_messages WHERE consumer = :job"),
    sa.text("DELETE FROM completer_operations WHERE :operation = ANY (operations)"),
    sa.text("DELETE FROM worker_passes WHERE host = :host AND last_pass_at >= :began"),
)


@contextmanager
def existing_database(url: str) -> Iterator[str]:
    """``url``, once its database is found fit for a run; emptied of the run on exit.
    Raises :class:`~recoverypoint.ConfigurationError` for a database not fit."""
    db = create_engine(url, poolclass=NullPool)
    try:
        began = _check(db)
        try:
            yield url
        finally:
            _clean(db, began)
    finally:
        db.dispose()


def _check(db: sa.Engine) -> datetime:
    """Refuse the database (see the module's docstring); return its clock's time."""
    name = db.url.database
    try:
        with db.connect() as conn:
            began: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
            present = conn.execute(_PRESENT, {"tables": list(TABLES)}).scalars().all()
            others, leftovers = False, False
            if conn.scalar(sa.text("SELECT to_regclass('idempotency_keys') IS NOT NULL")):
                names = {"operation": OPERATION, "job": RECEIPT_JOB}
                others, leftovers = (
                    any(conn.execute(query, names).first() for query in queries)
                    for queries in _HELD
                )
    except DBAPIError as exc:
        if not _exists(db):
            raise ConfigurationError(
                f"database {name!r} does not exist: --existing runs in a database you made; "
                f"create it first (createdb {name}; on Citus on every node, with the "
                "extension and the workers added), or leave out --existing for a database "
                "the demo creates and drops"
            ) from exc
        raise
    if present:
        raise ConfigurationError(
            f"database {name!r} already has tables the demo writes into: "
            f"{', '.join(present)} (an earlier run's, or yours by the same names); the demo "
            "leaves your tables alone, so run it in another database, or, if they are what "
            f"a run cut short left, drop them (DROP TABLE {', '.join(present)})"
        )
    if others:
        raise ConfigurationError(
            f"database {name!r} holds idempotency keys or staged jobs already; the demo "
            "checks every key and job in the database, and would count yours: run it in a "
            "database without them"
        )
    if leftovers:
        raise ConfigurationError(
            f"database {name!r} holds keys or jobs of a demo run cut short; the demo would "
            "count them with its own: delete them (DELETE FROM idempotency_keys WHERE "
            f"operation = '{OPERATION}'; DELETE FROM staged_jobs WHERE job_name = "
            f"'{RECEIPT_JOB}') or run it in another database"
        )
    return began


def _exists(db: sa.Engine) -> bool:
    """Whether the server has ``db``'s database, asked of its ``postgres`` database (a
    failed connection's error has no SQLSTATE to tell); ``True`` when that fails too, so
    that the first error is the one shown."""
    server = create_engine(db.url.set(database="postgres"), poolclass=NullPool)
    try:
        with server.connect() as conn:
            return bool(conn.execute(_NAMED, {"name": db.url.database}).scalar_one())
    except DBAPIError:
        return True
    finally:
        server.dispose()


def _clean(db: sa.Engine, began: datetime) -> None:
    """Drop Rocket Rides' tables and delete the run's rows from recoverypoint's."""
    with db.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")
        if conn.scalar(sa.text("SELECT to_regclass('idempotency_keys') IS NOT NULL")):
            values = {
                "operation": OPERATION,
                "job": RECEIPT_JOB,
                "host": socket.gethostname(),
                "began": began,
            }
            for statement in _CLEAN:
                conn.execute(statement, values)
