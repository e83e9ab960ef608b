"""The schema's delivery: ``recoverypoint migrate`` (online and ``--sql``), Alembic run from
the checkout, and no drift between the revisions and ``recoverypoint.schema``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.pool import NullPool

from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.distribute import SCOPED_KEY
from recoverypoint.jobs import consume_once
from recoverypoint.schema import metadata

REPO_ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE_URL = "postgresql://127.0.0.1:1/x"  # nothing listens on port 1
# Every revision, oldest first; the last one is the head.
REVISIONS = (
    "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011", "0012",
    "0013", "0014", "0015", "0016", "0017",
)
HEAD = REVISIONS[-1]
TABLES = {
    "idempotency_keys",
    "staged_jobs",
    "processed_messages",
    "worker_passes",
    "completer_operations",
    "audit_log",
    "installation_secrets",
    "recoverypoint_namespace",
    "key_generations",
}


def run_cli(*args: str, database_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m recoverypoint ARGS`` with RECOVERYPOINT_DATABASE_URL set only if given."""
    env = {k: v for k, v in os.environ.items() if k != "RECOVERYPOINT_DATABASE_URL"}
    if database_url is not None:
        env["RECOVERYPOINT_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def query(url: str, sql: str) -> list[Any]:
    """The first column of ``sql``'s rows, on a connection of its own."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return list(connection.execute(sa.text(sql)).scalars())
    finally:
        engine.dispose()


def versions(url: str) -> list[str]:
    return query(url, "SELECT version_num FROM recoverypoint_alembic_version")


def tables(url: str) -> set[str]:
    return set(query(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))


def plain_postgresql(url: str) -> str:
    """The URL as users write it, without SQLAlchemy's driver suffix."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.mark.slow
def test_migrate_applies_every_revision_once_then_is_a_no_op(empty_database_url: str) -> None:
    first = run_cli("migrate", "--database-url", plain_postgresql(empty_database_url))
    assert first.returncode == 0, first.stderr
    assert first.stdout == (
        f"applied {', '.join(REVISIONS)}; recoverypoint schema is at revision {HEAD} (head)\n"
    )

    # The second run takes its URL from the environment, as a deployment would.
    second = run_cli("migrate", database_url=empty_database_url)
    assert second.returncode == 0, second.stderr
    assert second.stdout == f"recoverypoint schema is at revision {HEAD} (head)\n"

    assert versions(empty_database_url) == [HEAD]
    # in particular no `alembic_version`: that name belongs to the application
    assert tables(empty_database_url) == {*TABLES, migrate.VERSION_TABLE}


@pytest.mark.slow
def test_migrate_leaves_the_applications_alembic_history_alone(empty_database_url: str) -> None:
    engine = create_engine(empty_database_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"
        )
        connection.exec_driver_sql("INSERT INTO alembic_version VALUES ('ae1027a6acf')")
    engine.dispose()

    result = run_cli("migrate", "--database-url", empty_database_url)

    assert result.returncode == 0, result.stderr
    assert query(empty_database_url, "SELECT version_num FROM alembic_version") == ["ae1027a6acf"]
    assert versions(empty_database_url) == [HEAD]


@pytest.mark.parametrize(
    ("args", "env_url"),
    [([], None), (["--database-url", UNREACHABLE_URL], UNREACHABLE_URL)],
    ids=["no-url", "unreachable-url"],
)
@pytest.mark.slow
def test_sql_prints_the_ddl_without_touching_a_database(
    args: Sequence[str], env_url: str | None
) -> None:
    # An unreachable URL must not matter: offline mode never connects.
    result = run_cli("migrate", "--sql", *args, database_url=env_url)

    assert result.returncode == 0, result.stderr
    for statement in (
        "CREATE TABLE idempotency_keys",
        "CREATE TABLE staged_jobs",
        "CREATE TABLE processed_messages",
        "CREATE INDEX idempotency_keys_unfinished",
        f"CREATE TABLE {migrate.VERSION_TABLE}",
        f"INSERT INTO {migrate.VERSION_TABLE} (version_num) VALUES ('0001')",
        "COMMIT;",
    ):
        assert statement in result.stdout
    assert re.search(r"(?<!recoverypoint_)alembic_version", result.stdout) is None


def _schema_diff(connection: sa.Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection,
        opts={
            "compare_type": True,
            "compare_server_default": True,
            # Alembic's bookkeeping is not part of recoverypoint.schema.
            "include_name": lambda name, type_, parents: name != migrate.VERSION_TABLE,
        },
    )
    diff: list[Any] = compare_metadata(context, metadata)
    return diff


@pytest.mark.slow
def test_migrated_schema_matches_the_schema_module(empty_database_url: str) -> None:
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            # The comparison sees our tables at all: before migrating, both are missing.
            missing = {diff[1].name for diff in _schema_diff(connection) if diff[0] == "add_table"}
            assert missing == TABLES

        assert migrate.upgrade(engine).applied == REVISIONS
        assert migrate.upgrade(engine).applied == ()

        with engine.connect() as connection:
            assert _schema_diff(connection) == []

            # Alembic does not compare CHECK constraints or partial-index predicates.
            inspector = sa.inspect(connection)
            for table in metadata.tables.values():
                declared_checks = {
                    c.name for c in table.constraints if isinstance(c, sa.CheckConstraint)
                }
                found_checks = {c["name"] for c in inspector.get_check_constraints(table.name)}
                assert found_checks == declared_checks, table.name

                declared_where = {
                    index.name: _normalise(index.dialect_options["postgresql"]["where"])
                    for index in table.indexes
                }
                found_where = {
                    index["name"]: _normalise(
                        index.get("dialect_options", {}).get("postgresql_where")
                    )
                    for index in inspector.get_indexes(table.name)
                    if not index.get("duplicates_constraint")
                }
                assert found_where == declared_where, table.name

                # Nor the order of a unique constraint's columns, which decides the lookups
                # its index serves (a search by the client's key alone, for one).
                declared_unique = {
                    c.name: [column.name for column in c.columns]
                    for c in table.constraints
                    if isinstance(c, sa.UniqueConstraint) and c.name
                }
                found_unique = {
                    c["name"]: c["column_names"]
                    for c in inspector.get_unique_constraints(table.name)
                    if c["name"] in declared_unique
                }
                assert found_unique == declared_unique, table.name
    finally:
        engine.dispose()


def _normalise(where: object) -> str | None:
    """A predicate compared without the parentheses PostgreSQL adds when it prints one."""
    return None if where is None else str(where).replace("(", "").replace(")", "")


@pytest.mark.slow
def test_concurrent_migrators_apply_the_revision_once(empty_database_url: str) -> None:
    # Instances starting at once: separate processes, serialised by env.py's advisory lock.
    env = {**os.environ, "RECOVERYPOINT_DATABASE_URL": empty_database_url}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "recoverypoint", "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]

    assert [process.returncode for process in processes] == [0] * 4, outputs
    assert sum(stdout.startswith("applied ") for stdout, _ in outputs) == 1
    assert versions(empty_database_url) == [HEAD]


def test_concurrent_threads_apply_the_revision_once(empty_database_url: str) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(migrate.upgrade, [empty_database_url] * 4))

    assert sorted(r.applied for r in results) == [(), (), (), REVISIONS]


def test_session_database_is_at_head(database_url: str) -> None:
    assert versions(database_url) == [HEAD]


@pytest.mark.slow
def test_alembic_upgrade_head_from_the_checkout(empty_database_url: str) -> None:
    env = {**os.environ, "RECOVERYPOINT_DATABASE_URL": plain_postgresql(empty_database_url)}
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert versions(empty_database_url) == [HEAD]
    assert tables(empty_database_url) >= TABLES


@pytest.mark.slow
def test_migrate_without_a_url_says_what_to_pass() -> None:
    result = run_cli("migrate")

    assert result.returncode == 2
    assert "--database-url" in result.stderr
    assert "RECOVERYPOINT_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_migrate_on_an_unreachable_database_fails_in_one_line() -> None:
    result = run_cli("migrate", "--database-url", UNREACHABLE_URL)

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "127.0.0.1" in result.stderr and "refused" in result.stderr


def _alembic(url: str, *args: str) -> None:
    env = {**os.environ, "RECOVERYPOINT_DATABASE_URL": plain_postgresql(url)}
    result = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_scope_in_keys_keeps_keys_in_flight_and_the_applications_foreign_keys(
    empty_database_url: str,
) -> None:
    # An installation at 0010 with a key in flight, a staged job, and a table of its own
    # that references idempotency_keys (id), as Rocket Rides did.
    _alembic(empty_database_url, "upgrade", "0010")
    db = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with db.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE rides (id bigint PRIMARY KEY, "
                "idempotency_key_id bigint REFERENCES idempotency_keys (id) ON DELETE SET NULL)"
            )
            key_id = conn.exec_driver_sql(
                "INSERT INTO idempotency_keys (scope, operation, idempotency_key, "
                "operation_version, request_method, request_path, request_params, fingerprint, "
                "locked_at, lock_token) VALUES ('s', 'op', 'k', 1, 'POST', '/', '{}', 'f', "
                "now(), gen_random_uuid()) RETURNING id"
            ).scalar_one()
            conn.exec_driver_sql(f"INSERT INTO rides VALUES (1, {key_id})")
            conn.exec_driver_sql(
                "INSERT INTO staged_jobs (job_name, job_args, job_key, idempotency_key_id) "
                f"VALUES ('j', '{{}}', 'jk', {key_id}), ('orphan', '{{}}', 'ok', 999)"
            )

        _alembic(empty_database_url, "upgrade", "head")

        with db.connect() as conn:
            lease = conn.exec_driver_sql(
                "SELECT lock_token IS NOT NULL FROM idempotency_keys WHERE id = %s", (key_id,)
            ).scalar_one()
            scopes = conn.exec_driver_sql(
                "SELECT job_key, scope FROM staged_jobs ORDER BY job_key"
            ).all()
            keys = conn.exec_driver_sql(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = 'idempotency_keys'::regclass AND contype IN ('p', 'u') "
                "ORDER BY conname"
            ).all()
        assert lease  # the key in flight keeps its lease
        assert [tuple(row) for row in scopes] == [("jk", "s"), ("ok", "")]
        assert [tuple(row) for row in keys] == [
            ("idempotency_keys_id_key", "UNIQUE (id)"),
            ("idempotency_keys_pkey", "PRIMARY KEY (id, scope)"),
            ("idempotency_keys_scope_operation_key", "UNIQUE (idempotency_key, scope, operation)"),
        ]
        # The application's foreign key still holds, and still sets NULL on delete.
        with db.begin() as conn, pytest.raises(sa.exc.IntegrityError):
            conn.exec_driver_sql("INSERT INTO rides VALUES (2, 12345)")
        with db.begin() as conn:
            conn.exec_driver_sql(f"DELETE FROM idempotency_keys WHERE id = {key_id}")
            ride = conn.exec_driver_sql("SELECT idempotency_key_id FROM rides").scalar_one()
        assert ride is None
    finally:
        db.dispose()


# The previous release's consume_once statement, as it shipped (before migration 0014).
_PREVIOUS_MARK_PROCESSED = """
    INSERT INTO processed_messages (consumer, message_id) VALUES (:consumer, :message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING
    RETURNING true
    """


@pytest.mark.slow
def test_the_previous_releases_consumers_keep_working_after_0014(
    empty_database_url: str,
) -> None:
    # Migrate before you deploy: consumers of the previous release still run on the new
    # schema, side by side with the new release's.
    _alembic(empty_database_url, "upgrade", "0013")
    db = create_engine(empty_database_url, poolclass=NullPool)
    previous = sa.text(_PREVIOUS_MARK_PROCESSED)
    try:
        with db.begin() as conn:
            assert conn.execute(previous, {"consumer": "c", "message_id": "before"}).first()

        _alembic(empty_database_url, "upgrade", "head")

        def mark(message_id: str) -> bool:
            with db.begin() as conn:
                row = conn.execute(previous, {"consumer": "c", "message_id": message_id})
                return row.first() is not None

        assert mark("after") and not mark("after") and not mark("before")
        with db.begin() as conn:
            assert consume_once(conn, "c", "new")
            assert not consume_once(conn, "c", "after")  # the previous release's record
            assert not consume_once(conn, "c", "before")
        assert not mark("new")
        assert query(
            empty_database_url,
            "SELECT message_id || '/' || scope FROM processed_messages ORDER BY 1",
        ) == ["after/", "before/", "new/"]
    finally:
        db.dispose()


@pytest.mark.slow
def test_0014s_downgrade_keeps_one_record_per_consumer_and_message(
    empty_database_url: str,
) -> None:
    _alembic(empty_database_url, "upgrade", "head")
    db = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with db.begin() as conn:
            # The key migrate --citus gives the table, under which a message has twins.
            conn.exec_driver_sql(SCOPED_KEY["processed_messages"])
            for scope in ("", "a", "b"):
                assert consume_once(conn, "c", "m", scope=scope)
            assert consume_once(conn, "c", "other", scope="b")

        _alembic(empty_database_url, "downgrade", "0013")

        assert query(
            empty_database_url, "SELECT message_id FROM processed_messages ORDER BY 1"
        ) == ["m", "other"]
        with db.begin() as conn:
            key = conn.exec_driver_sql(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conname = 'processed_messages_pkey'"
            ).scalar_one()
            assert key == "PRIMARY KEY (consumer, message_id)"
            previous = sa.text(_PREVIOUS_MARK_PROCESSED)
            assert not conn.execute(previous, {"consumer": "c", "message_id": "m"}).first()
    finally:
        db.dispose()


_CHECKS = (
    "SELECT conname FROM pg_constraint "
    "WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'c' ORDER BY conname"
)
_UNFINISHED_ROW = (
    "INSERT INTO idempotency_keys (scope, operation, idempotency_key, operation_version, "
    "request_method, request_path, request_params, fingerprint, locked_at, lock_token{}) "
    "VALUES ('s', 'op', '{}', 1, 'POST', '/', '{{}}', 'f', now(), gen_random_uuid(){}) "
    "RETURNING id"
)


@pytest.mark.slow
def test_0017_drops_the_row_checks_and_its_downgrade_restores_them(
    empty_database_url: str,
) -> None:
    # An installation at 0016 with a key in flight and a finished one.
    _alembic(empty_database_url, "upgrade", "0016")
    db = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with db.begin() as conn:
            assert conn.exec_driver_sql(_CHECKS).scalars().all() == [
                "idempotency_keys_abandoned_finished",
                "idempotency_keys_finished",
            ]
            in_flight = conn.exec_driver_sql(_UNFINISHED_ROW.format("", "k1", "")).scalar_one()
            conn.exec_driver_sql(
                _UNFINISHED_ROW.format(", finished_at, response_status", "k2", ", now(), 201")
            )

        _alembic(empty_database_url, "upgrade", "head")

        with db.begin() as conn:
            assert conn.exec_driver_sql(_CHECKS).scalars().all() == []
            leased = conn.exec_driver_sql(
                "SELECT lock_token IS NOT NULL FROM idempotency_keys WHERE id = %s", (in_flight,)
            ).scalar_one()
            assert leased  # the key in flight keeps its lease

        _alembic(empty_database_url, "downgrade", "0016")
        with db.begin() as conn:
            assert len(conn.exec_driver_sql(_CHECKS).scalars().all()) == 2
        _alembic(empty_database_url, "upgrade", "head")

        # A row that is not whole, written by something else than recoverypoint: the
        # downgrade refuses to restore the checks over it, and changes nothing.
        with db.begin() as conn:
            conn.exec_driver_sql(
                _UNFINISHED_ROW.format(", finished_at", "k3", ", now()").replace(
                    "RETURNING id", ""
                )
            )
        with pytest.raises(AssertionError, match="idempotency_keys_finished"):
            _alembic(empty_database_url, "downgrade", "0016")
        version = "SELECT version_num FROM recoverypoint_alembic_version"
        assert query(empty_database_url, version) == ["0017"]
        with db.begin() as conn:
            conn.exec_driver_sql("DELETE FROM idempotency_keys WHERE idempotency_key = 'k3'")
    finally:
        db.dispose()
