"""The databases tests have to themselves (``own_databases`` in conftest.py): a copy of a
template a test is done with comes back to the next test as a new copy would be, or is
dropped. What every worker test relies on: it sees no row, sequence value or schema change
of the test before it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # each test creates a template and its copies, and drops them

TEMPLATE_SCHEMA = """
CREATE TABLE parents (id bigserial PRIMARY KEY, name text NOT NULL);
CREATE TABLE children (id bigserial PRIMARY KEY, parent bigint NOT NULL REFERENCES parents);
CREATE INDEX parents_name ON parents (name);
INSERT INTO parents (name) VALUES ('kept');
"""


@pytest.fixture
def template(server_url: str) -> Iterator[str]:
    """A template of this test alone: the pool of copies is per template."""
    with temporary_database(server_url, prefix="rp_own_template") as url:
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(TEMPLATE_SCHEMA)
        finally:
            engine.dispose()
        name = sa.make_url(url).database
        assert name is not None
        yield name


def run(url: str, *statements: str) -> list[Any]:
    """The last statement's first column, after all of them in one transaction."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for statement in statements:
                result = conn.execute(sa.text(statement))
            return list(result.scalars()) if result.returns_rows else []
    finally:
        engine.dispose()


PLANNED = """
    SELECT format('%s %s %s %s', relname, relpages, reltuples, relallvisible) FROM pg_class
    WHERE relname IN ('parents', 'children', 'parents_name', 'parents_pkey') ORDER BY relname
"""


def used(own_databases: Any, template: str, *statements: str) -> str:
    """The URL of a copy of ``template`` that ran ``statements``, once it is cleaned."""
    with own_databases.new(template) as url:
        run(url, *statements)
    settled(own_databases)
    return str(url)


def settled(own_databases: Any) -> None:
    """Once the cleans and drops asked for so far are done (each is one thread: in order)."""
    own_databases.cleaner.submit(lambda: None).result()
    own_databases.dropper.submit(lambda: None).result()


def exists(server_url: str, url: str) -> bool:
    name = sa.make_url(url).database
    return bool(run(server_url, f"SELECT count(*) FROM pg_database WHERE datname = '{name}'")[0])


def test_a_copy_whose_rows_were_written_comes_back_as_new(
    own_databases: Any, template: str
) -> None:
    with own_databases.new(template) as first:
        fresh = run(first, PLANNED)
    settled(own_databases)
    url = used(
        own_databases,
        template,
        "INSERT INTO parents (name) VALUES ('mine') RETURNING id",
        "INSERT INTO children (parent) SELECT id FROM parents",
        "UPDATE children SET parent = parent",
        "SELECT nextval('parents_id_seq')",
    )
    with own_databases.new(template) as again:
        assert again == url  # the same database, made new
        assert run(again, "SELECT name FROM parents") == ["kept"]
        assert run(again, "SELECT count(*) FROM children") == [0]
        assert run(again, "INSERT INTO parents (name) VALUES ('next') RETURNING id") == [2]
        assert run(again, "INSERT INTO children (parent) VALUES (2) RETURNING id") == [1]
        # As the planner sees them: a copy's figures (never vacuumed, planned as 10 pages).
        assert run(again, PLANNED) == fresh
        assert run(
            again,
            "SELECT pg_stat_clear_snapshot()",
            "SELECT n_tup_del + vacuum_count FROM pg_stat_user_tables WHERE relname = 'children'",
        ) == [0]


# Each leaves something deleting the test's rows would not undo.
SETTING = (
    "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET work_mem = ''8MB''', "
    "current_database()); END $$"
)


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param("CREATE TABLE extra (id int)", id="a table"),
        pytest.param("ALTER TABLE parents ADD COLUMN extra int", id="a column"),
        pytest.param("CREATE INDEX ON parents (name)", id="an index"),
        pytest.param("CREATE TEMPORARY TABLE scratch (id int)", id="a temporary table"),
        pytest.param(SETTING, id="a setting of the database"),
        pytest.param("DELETE FROM parents WHERE name = 'kept'", id="a row deleted"),
        pytest.param("UPDATE parents SET name = 'changed'", id="a row updated"),
        pytest.param("TRUNCATE children", id="a table truncated"),
        pytest.param("DROP INDEX parents_name", id="an index dropped"),
        pytest.param(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I CONNECTION LIMIT 50', "
            "current_database()); END $$",
            id="a limit of the database",
        ),
        pytest.param("ANALYZE parents", id="statistics gathered"),
        pytest.param(
            "INSERT INTO parents (name) SELECT 'many' || n FROM generate_series(1, 2000) AS n",
            id="an index grown",
        ),
    ],
)
def test_a_copy_that_cannot_be_made_new_is_dropped(
    own_databases: Any, template: str, server_url: str, statement: str
) -> None:
    url = used(own_databases, template, statement)
    assert not exists(server_url, url)
    with own_databases.new(template) as again:
        assert again != url
        assert run(again, "SELECT name FROM parents") == ["kept"]


def test_a_copy_someone_is_still_connected_to_is_dropped(
    own_databases: Any, template: str, server_url: str
) -> None:
    with own_databases.new(template) as url:
        left = create_engine(url, poolclass=NullPool).connect()  # a process that outlived it
    settled(own_databases)
    assert not exists(server_url, url)
    with pytest.raises(sa.exc.OperationalError):
        left.execute(sa.text("SELECT 1"))
    left.invalidate()


def test_a_copy_whose_test_failed_is_dropped(
    own_databases: Any, template: str, server_url: str
) -> None:
    with own_databases.new(template) as url:
        own_databases.spoil(url)  # as worker_database_url does when its test failed
    settled(own_databases)
    assert not exists(server_url, url)
