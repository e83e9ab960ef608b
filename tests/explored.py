"""A database of its own for an example that explore runs: migrated, with the example's tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.pool import NullPool

from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database


@contextmanager
def database_with(server_url: str, schema: str) -> Iterator[str]:
    """The URL of a new database with recoverypoint's schema and ``schema``, dropped after."""
    with temporary_database(server_url, prefix="rp_explore") as url:
        migrate.upgrade(url)
        db = create_engine(url, poolclass=NullPool)
        with db.begin() as conn:
            conn.exec_driver_sql(schema)
        db.dispose()
        yield url
