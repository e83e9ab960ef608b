"""``recoverypoint demo --existing``: the demo in a database its user made, which holds
tables of the user's. They survive the run; what the demo made is gone after it; a
database the demo would mix its rows with, or one that does not exist, is refused with
nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine
from recoverypoint.demo.existing import existing_database
from recoverypoint.demo.harness import prepare
from recoverypoint.demo.rocket_rides.schema import TABLES
from recoverypoint.migrate import upgrade
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # the demo's processes, in a database made for it

# recoverypoint's tables the run writes into: empty before, empty after.
RECOVERYPOINT_ROWS = ("idempotency_keys", "staged_jobs", "processed_messages", "key_generations")


@pytest.fixture
def users_db(server_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """A database the user made, with a table of theirs (and a row in it) in it."""
    with temporary_database(server_url, prefix="rp_existing") as url:
        db = create_engine(url, poolclass=NullPool)
        with db.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY, total int)")
            conn.exec_driver_sql("INSERT INTO orders VALUES (1, 4200)")
        yield url, db
        db.dispose()


def demo(url: str, *options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERYPOINT_")}
    command = [sys.executable, "-m", "recoverypoint", "demo", "--requests", "20"]
    command += ["--concurrency", "4", "--seed", "5", "--database-url", url, *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def tables_of(db: sa.Engine) -> set[str]:
    return set(sa.inspect(db).get_table_names())


def count(db: sa.Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def run_in_it_and_check_it_is_left_as_found(url: str, db: sa.Engine, tmp_path: Path) -> None:
    """Run the demo with ``--existing`` in the database of ``url`` (``db``), which holds the
    user's ``orders`` row: every invariant holds, and the database is left as found."""
    out = tmp_path / "demo.json"
    ran = demo(url, "--existing", "--json", str(out))

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "every invariant holds" in ran.stdout
    report = json.loads(out.read_text())
    assert report["figures"]["requests sent"] == 20
    assert all(inv["count"] == 0 for inv in report["invariants"].values())
    # The user's table and its row, untouched; none of the example's tables left.
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT id, total FROM orders")).all() == [(1, 4200)]
    assert not tables_of(db) & set(TABLES)
    # recoverypoint's tables stay, migrated, without a row of the run's.
    assert {"idempotency_keys", "staged_jobs", "recoverypoint_alembic_version"} <= tables_of(db)
    assert all(count(db, table) == 0 for table in RECOVERYPOINT_ROWS)
    assert count(db, "worker_passes") == 0


def test_the_demo_runs_in_the_users_database_and_leaves_it_as_it_found_it(
    users_db: tuple[str, sa.Engine], tmp_path: Path
) -> None:
    url, db = users_db
    run_in_it_and_check_it_is_left_as_found(url, db, tmp_path)
    # So the same database takes the next run.
    again = demo(url, "--existing", "--requests", "4")
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_database_that_does_not_exist_is_named_and_not_created(server_url: str) -> None:
    missing = make_url(server_url).set(database="rp_existing_never_made")
    ran = demo(missing.render_as_string(hide_password=False), "--existing")

    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "database 'rp_existing_never_made' does not exist" in ran.stderr
    assert "createdb rp_existing_never_made" in ran.stderr
    assert "Traceback" not in ran.stderr
    server = create_engine(server_url, poolclass=NullPool)
    try:
        with server.connect() as conn:
            found = "SELECT count(*) FROM pg_database WHERE datname = 'rp_existing_never_made'"
            assert conn.execute(sa.text(found)).scalar_one() == 0
    finally:
        server.dispose()


@pytest.mark.parametrize("table", ["users", "rides"])
def test_a_table_by_one_of_the_demos_names_is_refused_and_kept(
    users_db: tuple[str, sa.Engine], table: str
) -> None:
    """A user's own ``users`` (the demo would seed its users into it), or a leftover."""
    url, db = users_db
    with db.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (7)")
    ran = demo(url, "--existing")

    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert f"already has tables the demo writes into: {table} " in ran.stderr
    assert f"(DROP TABLE {table})" in ran.stderr
    assert "Traceback" not in ran.stderr
    # Nothing written: the table as it was, recoverypoint's not made.
    assert tables_of(db) == {"orders", table}
    assert count(db, table) == 1


@pytest.mark.parametrize(
    ("job", "says"),
    [
        ("send_invoice", "holds idempotency keys or staged jobs already"),
        # A run killed before it cleaned up: the way out is in the message.
        ("send_ride_receipt", "DELETE FROM staged_jobs WHERE job_name = 'send_ride_receipt'"),
    ],
)
def test_a_database_with_keys_or_jobs_is_refused(
    users_db: tuple[str, sa.Engine], job: str, says: str
) -> None:
    url, db = users_db
    upgrade(db)
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO staged_jobs (job_name, job_args, job_key, scope) "
                "VALUES (:job, '{}', 'k1', 'tenant-1')"
            ),
            {"job": job},
        )
    ran = demo(url, "--existing")

    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert says in ran.stderr
    assert count(db, "staged_jobs") == 1
    assert not tables_of(db) & set(TABLES)


def test_without_a_url_existing_says_what_it_needs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERYPOINT_")}
    ran = subprocess.run(
        [sys.executable, "-m", "recoverypoint", "demo", "--existing"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert ran.returncode == 2
    assert "--existing needs --database-url URL" in ran.stderr


def test_a_run_that_fails_midway_is_cleaned_up_too(users_db: tuple[str, sa.Engine]) -> None:
    url, db = users_db
    with pytest.raises(KeyboardInterrupt), existing_database(url):
        prepare(db)
        assert set(TABLES) <= tables_of(db)
        raise KeyboardInterrupt
    assert tables_of(db) & set(TABLES) == set()
    assert count(db, "orders") == 1
