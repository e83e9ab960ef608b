"""What explore's failover puts back: a table's rows read with COPY and written back as they
were, value for value, whatever they hold; and which tables a commit changed, told from
their rows before and after it, in whatever order COPY gives them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from explored import database_with
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from recoverypoint import _failover

SCHEMA = """
CREATE TABLE notes (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body text,
                    tags text[], doc jsonb, amount numeric, at timestamptz);
"""
# Anything a text column holds: every character but NUL, which PostgreSQL refuses, and a
# lone surrogate, which UTF-8 cannot encode (hypothesis draws them once categories are set).
TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=20)
ROWS = st.lists(
    st.tuples(
        st.none() | TEXT,
        st.none() | st.lists(TEXT, max_size=3),
        st.none() | st.dictionaries(TEXT, TEXT | st.integers(), max_size=3),
        st.none() | st.decimals(allow_nan=False, allow_infinity=False, places=4),
    ),
    max_size=5,
)


@pytest.fixture(scope="module")
def notes(server_url: str) -> Iterator[psycopg.Connection[Any]]:
    with database_with(server_url, SCHEMA) as url:
        conninfo = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            yield conn


def fill(conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> None:
    conn.execute("DELETE FROM notes")
    with conn.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO notes (body, tags, doc, amount, at) VALUES (%s, %s, %s, %s, now())",
            [
                (body, tags, psycopg.types.json.Jsonb(doc), amount)
                for body, tags, doc, amount in rows
            ],
        )


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=ROWS, after=ROWS)
@pytest.mark.slow
def test_rows_put_back_are_the_rows_read(
    notes: psycopg.Connection[Any], before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]
) -> None:
    fill(notes, before)
    kept = _failover.read(notes, ["notes"])
    fill(notes, after)  # what the lost commit wrote
    _failover.put_back(notes, kept, ["notes"])
    # The same rows, in whatever order COPY gives them (it promises none).
    assert in_any_order(_failover.read(notes, ["notes"])) == in_any_order(kept)


def in_any_order(rows: dict[str, str]) -> dict[str, list[str]]:
    return {name: sorted(text.split("\n")) for name, text in rows.items()}


LINES = st.lists(TEXT.filter(lambda row: "\n" not in row), max_size=5)


def table(rows: list[str]) -> str:
    """Rows as COPY writes them: each ends with a newline, which no value holds unescaped."""
    return "".join(f"{row}\n" for row in rows)


@given(rows=LINES, data=st.data())
def test_rows_in_another_order_are_no_change(rows: list[str], data: st.DataObject) -> None:
    shuffled = data.draw(st.permutations(rows))
    assert _failover.written({"t": table(rows)}, {"t": table(shuffled)}) == {}


@given(rows=LINES, changed=LINES)
@example(rows=["x\u2028y"], changed=["x", "y"])  # a separator to splitlines, not to COPY
def test_other_rows_are_a_change(rows: list[str], changed: list[str]) -> None:
    lost = _failover.written({"t": table(rows)}, {"t": table(changed)})
    assert lost == ({} if sorted(changed) == sorted(rows) else {"t": table(rows)})
