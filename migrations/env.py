"""Alembic environment for recoverypoint's own tables.

It runs three ways:

- ``recoverypoint migrate`` and :func:`recoverypoint.migrate.upgrade` build the configuration
  in code and hand over an open connection in ``config.attributes["connection"]``;
- ``alembic upgrade head`` from a checkout (alembic.ini) connects to ``sqlalchemy.url`` if
  the caller set it, else to ``RECOVERYPOINT_DATABASE_URL``;
- offline (``--sql``) it writes PostgreSQL DDL and needs no database at all.

The version table is ``recoverypoint_alembic_version``, so an application's own
``alembic_version`` is never read or written.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context
from alembic.util import CommandError
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine
from recoverypoint.migrate import CONNECTION, ON_VERSION_APPLY, VERSION_TABLE
from recoverypoint.schema import metadata

config = context.config
target_metadata = metadata

if config.config_file_name is not None:
    fileConfig(config.config_file_name)  # alembic.ini's logging, when run from the alembic CLI


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Autogenerate compares recoverypoint's tables only: the database is shared with the
    application, whose tables must never show up as "removed"."""
    return type_ != "table" or name in target_metadata.tables


def configure(connection: sa.Connection | None) -> None:
    context.configure(
        connection=connection,
        # Offline there is no connection: plain PostgreSQL DDL, whatever URL may be around.
        dialect_name=None if connection is not None else "postgresql",
        literal_binds=connection is None,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        compare_server_default=True,
        on_version_apply=config.attributes.get(ON_VERSION_APPLY),
    )


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("RECOVERYPOINT_DATABASE_URL")
    if not url:
        raise CommandError(
            "no database URL: set RECOVERYPOINT_DATABASE_URL=postgresql://user:password@host/db"
        )
    return url


def run_migrations(connection: sa.Connection) -> None:
    configure(connection=connection)
    with context.begin_transaction():
        # Several instances may migrate at start-up at once: the first one to get the lock
        # does the work, the others wait and then find the schema current. Released at commit.
        connection.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": VERSION_TABLE}
        )
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get(CONNECTION)
    if connection is not None:
        run_migrations(connection)
        return
    engine = create_engine(database_url(), poolclass=NullPool)  # any postgres:// form
    try:
        with engine.connect() as own_connection:
            run_migrations(own_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    configure(None)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_online()
