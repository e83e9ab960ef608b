"""Apply recoverypoint's schema: to a database, or as SQL for teams that run DDL themselves.

The Alembic environment and revisions ship inside the wheel as ``recoverypoint/_migrations``;
a source checkout uses its top-level ``migrations/``. Their version table is
:data:`VERSION_TABLE`, not Alembic's ``alembic_version``, so recoverypoint's history lives
beside an application's own Alembic history in the same database without touching it.

No ``alembic.ini`` is needed: the configuration is built here. Alembic itself is imported
by the functions that migrate or read the revisions, not with this module: the commands and
the pytest plugin that only name :data:`VERSION_TABLE` start without it (0.15 s of CPU).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine
from recoverypoint.errors import ConfigurationError

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.runtime.migration import MigrationInfo

VERSION_TABLE = "recoverypoint_alembic_version"

# Keys of ``Config.attributes`` that migrations/env.py reads.
CONNECTION = "connection"  # the name Alembic's own cookbook uses
ON_VERSION_APPLY = "recoverypoint.on_version_apply"

# Alembic's `context` and `op` are module globals: one migration at a time per process.
# Across processes, env.py's advisory lock does the same job.
_alembic_lock = threading.Lock()


@dataclass(frozen=True)
class UpgradeResult:
    """What :func:`upgrade` did."""

    applied: tuple[str, ...]
    """Revisions this call applied, oldest first; empty when the schema was already current."""
    revision: str
    """The revision the database is at now: always the head of recoverypoint's history."""


@dataclass(frozen=True)
class History:
    """This version's revisions, as its migrations hold them."""

    head: str
    revisions: frozenset[str]
    """Every revision, the head's included."""


@functools.cache  # the migrations do not change while the process runs
def history() -> History:
    """This version's head and revisions, read from its migrations."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    head = script.get_current_head()
    assert head is not None, "recoverypoint's migrations have no revisions"
    return History(head, frozenset(revision.revision for revision in script.walk_revisions()))


def migrations_dir() -> Path:
    """The directory holding recoverypoint's Alembic ``env.py`` and ``versions/``."""
    packaged = resources.files("recoverypoint") / "_migrations"
    # Alembic reads plain files, so only a real directory will do (not a zip import).
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    # An editable install or a checkout on sys.path: src/recoverypoint/ -> the repo root.
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"recoverypoint's migrations are missing (looked in {packaged} and {checkout}); "
        "reinstall recoverypoint"
    )


def upgrade(url_or_engine: str | URL | sa.Engine) -> UpgradeResult:
    """Bring the database to the newest schema; a database already there is left alone.

    Concurrent callers, in threads or in processes (several instances starting at once),
    are serialised: the first applies the revisions, the others find the work done.
    """
    from alembic import command

    engine = create_engine(url_or_engine, poolclass=NullPool)
    applied: list[str] = []

    def record(*, step: MigrationInfo, **_: Any) -> None:
        applied.extend(step.up_revision_ids)

    config = _config()
    config.attributes[ON_VERSION_APPLY] = record
    try:
        with _alembic_lock, engine.connect() as connection:
            # Whatever the engine's default: after waiting for env.py's lock, the version
            # table must be read as a concurrent migrator committed it.
            connection.execution_options(isolation_level="READ COMMITTED")
            # One transaction for the lock and every revision: PostgreSQL DDL is
            # transactional, so a failed upgrade leaves the schema as it was.
            with connection.begin():
                config.attributes[CONNECTION] = connection
                command.upgrade(config, "head")
    finally:
        if engine is not url_or_engine:
            engine.dispose()
    return UpgradeResult(applied=tuple(applied), revision=history().head)


def check_schema(db: sa.Engine) -> None:
    """Raise :class:`~recoverypoint.ConfigurationError` unless the database holds
    recoverypoint's schema at this version's revision (or at a newer one: a newer
    recoverypoint migrated it, and its schema still holds this version's)."""
    with db.connect() as conn:
        current = None
        if sa.inspect(conn).has_table(VERSION_TABLE):
            current = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    url = db.url.render_as_string(hide_password=True)
    if current is None:
        raise ConfigurationError(
            f"the database {url} has no recoverypoint schema: run `recoverypoint migrate` "
            "(or apply `recoverypoint migrate --sql`) before serving requests"
        )
    ours = history()
    if current in ours.revisions - {ours.head}:
        raise ConfigurationError(
            f"the database {url} has recoverypoint's schema at revision {current}, and this "
            f"version needs {ours.head}: run `recoverypoint migrate`"
        )


def upgrade_sql(out: TextIO) -> None:
    """Write the SQL that creates the newest schema to ``out``; no database is contacted."""
    from alembic import command

    with _alembic_lock:
        command.upgrade(_config(output_buffer=out), "head", sql=True)


def _config(**kwargs: Any) -> Config:
    from alembic.config import Config

    config = Config(**kwargs)
    # configparser would read a "%" in the path as interpolation.
    config.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    return config
