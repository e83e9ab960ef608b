"""A database made unavailable for a while, for the tests of what callers and workers see
during an outage: it refuses connections, and the ones it had are killed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine


@contextmanager
def database_down(server_url: str, database_url: str) -> Iterator[None]:
    """While inside, ``database_url``'s database refuses connections, and every
    connection it had was killed on the way in."""
    name = sa.make_url(database_url).database
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            terminate(conn, name)
        yield
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.dispose()


def terminate(conn: sa.Connection, database: str | None) -> int:
    """Kill every backend of ``database`` but ``conn``'s own; how many were killed."""
    killed = conn.execute(
        sa.text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = :n"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ),
        {"n": database},
    ).scalar_one()
    return int(killed)
