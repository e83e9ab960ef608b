"""Distribute recoverypoint's tables on Citus, by scope, and co-locate an application's own.

On a Citus coordinator, after ``recoverypoint migrate``:

- ``idempotency_keys`` is distributed by ``scope``, and ``staged_jobs``, ``key_generations``
  and ``processed_messages`` with it (co-located: a key's staged jobs and recorded
  generation live on its shard, so a phase that stages jobs, and a claim or deletion that
  reads or records the generation, commits on one worker, without two-phase commit; so does
  a consumer's record of a job of the scope, with the consumer's writes to the scope's rows);
- the small tables every process reads or writes by their own keys (``worker_passes``,
  ``completer_operations``, ``recoverypoint_namespace``, ``audit_log``,
  ``installation_secrets``) become reference tables, copied to every worker;
- each of the application's tables named in ``colocate`` is distributed by its scope
  column (``table`` or ``table:column``; ``scope`` by default) and co-located with
  ``idempotency_keys``, so a phase that writes its scope's rows there stays on one worker.

A table already distributed is left alone, so running it again is harmless; a reference
table that is now to be distributed (``processed_messages``, before migration 0014) is
turned back into a local table first (``undistribute_table``), then distributed, its rows
with it. ``processed_messages`` first gets the scope into its primary key
(:data:`SCOPED_KEY`): Citus wants the distribution column in it, and the previous
release's consumers, whose insert names the key without it, must be gone by then. The SQL
is :func:`statements`: a team that runs DDL itself applies that instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import sqlalchemy as sa

from .errors import ConfigurationError

DISTRIBUTED = "idempotency_keys"
CO_LOCATED = ("staged_jobs", "key_generations", "processed_messages")
# One server keeps (consumer, message_id), the key the previous release's consumers insert
# under (migration 0014); a table distributed by scope needs the scope in its key.
SCOPED_KEY = {
    "processed_messages": "ALTER TABLE processed_messages "
    "DROP CONSTRAINT processed_messages_pkey, "
    "ADD CONSTRAINT processed_messages_pkey PRIMARY KEY (consumer, message_id, scope)"
}
REFERENCE = (
    "worker_passes",
    "completer_operations",
    "recoverypoint_namespace",
    "audit_log",
    "installation_secrets",
)

# A table name as a user writes it on the command line, optionally schema-qualified, and
# its column: plain identifiers only (quoted names are passed to Citus as regclass text).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*(?:\.[A-Za-z_][A-Za-z0-9_$]*)?")
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


def parse_colocated(spec: str) -> tuple[str, str]:
    """``table`` or ``table:column`` as (table, column); :class:`ValueError` otherwise."""
    table, _, column = spec.partition(":")
    column = column or "scope"
    if _NAME.fullmatch(table) is None or _COLUMN.fullmatch(column) is None:
        raise ValueError(
            f"not a table to co-locate: {spec!r}; write TABLE or TABLE:COLUMN "
            "(e.g. rides or billing.charges:tenant_id)"
        )
    return table, column


def statements(colocate: Sequence[str] = ()) -> list[str]:
    """The SQL that distributes recoverypoint's tables and ``colocate``, in order."""
    out = [f"SELECT create_distributed_table('{DISTRIBUTED}', 'scope');"]
    for t in CO_LOCATED:
        if t in SCOPED_KEY:
            out.append(f"{SCOPED_KEY[t]};")
        out.append(
            f"SELECT create_distributed_table('{t}', 'scope', colocate_with => '{DISTRIBUTED}');"
        )
    out += [f"SELECT create_reference_table('{t}');" for t in REFERENCE]
    for spec in colocate:
        table, column = parse_colocated(spec)
        out.append(
            f"SELECT create_distributed_table('{table}', '{column}', "
            f"colocate_with => '{DISTRIBUTED}');"
        )
    return out


CITUS_INSTALLED = "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
_HAS_CITUS = sa.text(CITUS_INSTALLED)
# How Citus holds a table: no row when it does not, else whether it is a reference table.
_PLACED = sa.text(
    "SELECT partmethod = 'n' AND repmodel = 't' FROM pg_dist_partition "
    "WHERE logicalrelid = CAST(:t AS regclass)"
)
_UNDISTRIBUTE = sa.text("SELECT undistribute_table(CAST(:t AS regclass))")
_DISTRIBUTE = sa.text(
    "SELECT create_distributed_table(CAST(:t AS regclass), :column, colocate_with => :with)"
)
_REFERENCE = sa.text("SELECT create_reference_table(CAST(:t AS regclass))")


def has_citus(db: sa.Engine) -> bool:
    """Whether ``db`` has the citus extension (a coordinator's database)."""
    with db.connect() as conn:
        return bool(conn.execute(_HAS_CITUS).scalar())


def require_citus(db: sa.Engine) -> None:
    """Raise :class:`ConfigurationError` unless ``db`` has the citus extension."""
    if not has_citus(db):
        raise ConfigurationError(
            "this database has no citus extension: run `CREATE EXTENSION citus` on the "
            "coordinator (and add its workers) before distributing; a single server "
            "needs no distribution"
        )


def distribute(db: sa.Engine, colocate: Sequence[str] = ()) -> list[str]:
    """Distribute the tables (see the module's docstring) on the Citus coordinator ``db``;
    returns the tables it placed this time. Raises :class:`ConfigurationError` on a
    database without Citus, :class:`ValueError` for a bad ``colocate`` entry."""
    wanted = [parse_colocated(spec) for spec in colocate]
    require_citus(db)
    placed: list[str] = []
    with db.begin() as conn:
        plan = [(DISTRIBUTED, "scope", "default")]
        plan += [(t, "scope", DISTRIBUTED) for t in CO_LOCATED]
        plan += [(t, c, DISTRIBUTED) for t, c in wanted]
        for table, column, with_ in plan:
            reference = conn.execute(_PLACED, {"t": table}).scalar_one_or_none()
            if reference is False:  # distributed already
                continue
            if reference:  # processed_messages before migration 0014, or one to co-locate
                conn.execute(_UNDISTRIBUTE, {"t": table})
            if table in SCOPED_KEY:
                conn.exec_driver_sql(SCOPED_KEY[table])
            conn.execute(_DISTRIBUTE, {"t": table, "column": column, "with": with_})
            placed.append(table)
        placed += _make_reference(conn, REFERENCE)
    return placed


def make_reference(db: sa.Engine, tables: Sequence[str]) -> list[str]:
    """Make the application's ``tables`` reference tables on the Citus coordinator ``db``
    (before :func:`distribute` co-locates a table with a foreign key onto one of them);
    returns those it placed this time: one placed already is left alone."""
    for table in tables:
        if _NAME.fullmatch(table) is None:
            raise ValueError(f"not a table name: {table!r}")
    require_citus(db)
    with db.begin() as conn:
        return _make_reference(conn, tables)


def _make_reference(conn: sa.Connection, tables: Sequence[str]) -> list[str]:
    placed = []
    for table in tables:
        if conn.execute(_PLACED, {"t": table}).scalar_one_or_none() is None:
            conn.execute(_REFERENCE, {"t": table})
            placed.append(table)
    return placed
