"""recoverypoint.testing.temporary_database: a database of its own, empty or copied from a
template, and gone at the end; on the test server."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database


def databases(server_url: str) -> set[str]:
    engine = create_engine(server_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.scalars(sa.text("SELECT datname FROM pg_database")))
    finally:
        engine.dispose()


def execute(url: str, *statements: str) -> list[tuple[object, ...]]:
    """Run ``statements`` in one transaction; the last one's rows."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for statement in statements:
                result = conn.execute(sa.text(statement))
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


# Names a caller may give: quotes, spaces, a statement's end, case and non-ASCII letters.
@pytest.mark.parametrize("name", ['rp "tpl"; DROP DATABASE postgres; --', "Rp_Tpl_ß", "tpl"])
@pytest.mark.slow
def test_a_copy_has_the_templates_tables_and_rows_and_is_dropped(
    server_url: str, name: str
) -> None:
    name = f"{name} {uuid.uuid4().hex[:8]}"  # not another run's
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    quoted = admin.dialect.identifier_preparer.quote_identifier(name)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
    try:
        template = sa.make_url(server_url).set(database=name).render_as_string(False)
        execute(template, "CREATE TABLE kept (n int)", "INSERT INTO kept VALUES (1), (2)")

        with temporary_database(server_url, template=name) as url:
            assert execute(url, "SELECT n FROM kept ORDER BY n") == [(1,), (2,)]
            execute(url, "INSERT INTO kept VALUES (3)")
            copy = sa.make_url(url).database
            assert copy != name and copy in databases(server_url)

        # The copy is gone; the template is still there, as it was.
        assert copy not in databases(server_url) and name in databases(server_url)
        assert execute(template, "SELECT count(*) FROM kept") == [(2,)]
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
        admin.dispose()


def test_a_missing_template_is_named_in_the_error_and_nothing_is_created(
    server_url: str,
) -> None:
    prefix = f"rp_missing_{uuid.uuid4().hex[:8]}"
    with (
        pytest.raises(sa.exc.DBAPIError, match='template database "rp_no_such" does not exist'),
        temporary_database(server_url, prefix, template="rp_no_such"),
    ):
        pass
    assert not [name for name in databases(server_url) if name.startswith(prefix)]
