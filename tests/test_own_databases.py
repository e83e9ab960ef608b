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

TEMPLATE_SCHEMA = """
CREATE TABLE parents (id bigserial PRIMARY KEY, name text NOT NULL);
CREATE TABLE children (id bigserial PRIMARY KEY, parent bigint NOT NULL REFERENCES parents);
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


def used(own_databases: Any, template: str, *statements: str) -> str:
    """The URL of a copy of ``template`` that ran ``statements``, once it is cleaned."""
    with own_databases.new(template) as url:
        run(url, *statements)
    own_databases.cleaner.submit(lambda: None).result()  # the cleaner is one thread: in order
    return str(url)


def exists(server_url: str, url: str) -> bool:
    name = sa.make_url(url).database
    return bool(run(server_url, f"SELECT count(*) FROM pg_database WHERE datname = '{name}'")[0])


def test_a_copy_whose_rows_were_written_comes_back_as_new(
    own_databases: Any, template: str
) -> None:
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
    own_databases.cleaner.submit(lambda: None).result()
    assert not exists(server_url, url)
    with pytest.raises(sa.exc.OperationalError):
        left.execute(sa.text("SELECT 1"))
    left.invalidate()
