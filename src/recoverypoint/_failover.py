"""What a failover to a standby that lags loses, for :func:`recoverypoint.explore.explore`:
the tables a commit wrote, as they were just before it, put back once the primary is gone.

A table is read whole with ``COPY ... TO STDOUT`` (text format), which writes back with
``COPY ... FROM STDIN`` value for value, whatever the column types (identity columns
included), and needs no key to tell rows apart. The tables explore runs on hold the rows
of one schedule, a few each: reading them whole, twice per failover, is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

# A table's name (as the caller gave it) → its rows, in COPY's text format.
Rows = dict[str, str]


def read(conn: psycopg.Connection[Any], tables: Sequence[str]) -> Rows:
    """The rows of ``tables``, as a connection outside any open transaction sees them."""
    rows = {}
    with conn.cursor() as cursor:
        for table in tables:
            with cursor.copy(f"COPY {table} TO STDOUT") as copy:
                rows[table] = b"".join(bytes(chunk) for chunk in copy).decode()
    return rows


def written(before: Rows, after: Rows) -> Rows:
    """The tables whose rows changed from ``before`` to ``after``, as they were before.
    Rows are compared as a multiset: COPY gives them in no promised order. COPY ends each
    with a newline and escapes those in values, not every character ``splitlines`` splits
    at (U+2028, U+0085)."""
    return {
        table: rows
        for table, rows in before.items()
        if sorted(rows.split("\n")) != sorted(after[table].split("\n"))
    }


def put_back(conn: psycopg.Connection[Any], lost: Rows, order: Sequence[str]) -> None:
    """Put the tables of ``lost`` back as they were, in one transaction: emptied in
    ``order`` (a table before those it refers to), filled in the reverse order.

    As a standby replays its log: no trigger fires and no foreign key is checked (another
    table's rows may refer to a row emptied and filled again), when the role may set
    ``session_replication_role`` (a superuser, or one granted SET on it); otherwise the
    foreign keys that are DEFERRABLE are checked at the COMMIT, the rows back by then."""
    tables = [table for table in order if table in lost]
    with conn.transaction(), conn.cursor() as cursor:
        try:
            with conn.transaction():  # a savepoint: a refusal leaves the rest to run
                cursor.execute("SET LOCAL session_replication_role = replica")
        except psycopg.errors.InsufficientPrivilege:
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")
        for table in tables:
            cursor.execute(f"DELETE FROM {table}")
        for table in reversed(tables):
            with cursor.copy(f"COPY {table} FROM STDIN") as copy:
                copy.write(lost[table])
