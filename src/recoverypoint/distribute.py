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

- ``idempotency_keys`` gets two triggers: one (:data:`STAYS_IN_SCOPE`) refuses a phase that
  wrote rows of another scope's shard on its scope's worker; the other
  (:data:`BINDS_NEW_KEY`) binds the transaction of a new key's claim, where its first phase
  runs, to that worker, so that a phase that wrote on another worker too fails at its
  COMMIT.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa

from .errors import ConfigurationError
from .migrate import VERSION_TABLE

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

# A phase stays in its scope on its own worker too. A phase that writes on another worker
# fails at its COMMIT (the snapshot its transaction exported there: engine/sql.py, and
# BINDS_NEW_KEY below); one that writes another scope's shard on the same worker would
# commit there, in one transaction, and fail only once a rebalance puts the two scopes
# apart. So the write that records a phase (every one sets ``state``, under the lease: an
# operator's ``keys reconcile``, which sets it on a key no lease holds, records no phase)
# checks, on the worker, the shards that the distributed transaction's backends
# there hold a write's lock on (anything above a row lock: reads, SERIALIZABLE's SIReadLock
# and row locks are free, as a foreign key's check onto a reference table locks the row it
# finds): each must be in the key's shard group (its co-located shards), or the write raises
# LEFT_ITS_SCOPE, before COMMIT. A reference table's shard is in no shard group. The
# definer's rights, as the catalogs it reads may be closed to the application's role. Its
# queries take parameters (the transaction, the shard): planned once per connection (a
# generic plan), not anew at most calls, which cost the write a tenth of a millisecond and
# at times a millisecond.
# What the write that records a phase raises (the engine's PhaseLeftScope) when it does not.
LEFT_ITS_SCOPE = "RP003"
STAYS_IN_SCOPE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION recoverypoint_stays_in_scope() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog SET plan_cache_mode = force_generic_plan AS $fn$
DECLARE
    me record := get_current_transaction_id();
    key_shard bigint := get_shard_id_for_distribution_column(
        quote_ident(TG_TABLE_SCHEMA) || '.{DISTRIBUTED}', NEW.scope);
    group_of_key record;
    strays text;
BEGIN
    SELECT s.shardminvalue, p.colocationid INTO group_of_key
    FROM pg_dist_shard s JOIN pg_dist_partition p USING (logicalrelid)
    WHERE s.shardid = key_shard;
    SELECT string_agg(DISTINCT s.logicalrelid::text, ', ') INTO strays
    FROM pg_locks l
    JOIN get_all_active_transactions() t ON t.process_id = l.pid
    JOIN pg_class c ON c.oid = l.relation AND c.relkind IN ('r', 'p')
    JOIN pg_dist_shard s ON s.shardid = substring(c.relname FROM '_([0-9]+)$')::bigint
    JOIN pg_dist_partition p ON p.logicalrelid = s.logicalrelid
    WHERE t.transaction_number = me.transaction_number
      AND t.transaction_stamp = me.transaction_stamp
      AND l.locktype = 'relation'
      AND l.mode NOT IN ('AccessShareLock', 'RowShareLock', 'SIReadLock')
      AND (p.colocationid IS DISTINCT FROM group_of_key.colocationid
           OR s.shardminvalue IS DISTINCT FROM group_of_key.shardminvalue);
    IF strays IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '{LEFT_ITS_SCOPE}',
            MESSAGE = 'an atomic phase wrote outside its scope, in: ' || strays;
    END IF;
    RETURN NULL;
END
$fn$
"""
STAYS_IN_SCOPE = (
    f"CREATE OR REPLACE TRIGGER recoverypoint_stays_in_scope AFTER UPDATE OF state "
    f"ON {DISTRIBUTED} FOR EACH ROW WHEN (OLD.lock_token IS NOT NULL) "
    f"EXECUTE FUNCTION recoverypoint_stays_in_scope()"
)
# The claim that inserts a key row binds its transaction, where the new key's first atomic
# phase runs, to the scope's worker: it exports a snapshot there (see engine/sql.py's BIND),
# on the worker, before the phase's code runs. In a trigger, as Citus evaluates the
# functions of a write on the coordinator: a statement of the engine's after the claim cost
# a command to the worker per new key. Only claims insert key rows: one inserted by an
# ``INSERT ... SELECT``, which Citus commits by two-phase commit, fails.
BINDS_NEW_KEY_FUNCTION = """
CREATE OR REPLACE FUNCTION recoverypoint_binds_new_key() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_catalog.pg_export_snapshot();
    RETURN NULL;
END
$fn$
"""
BINDS_NEW_KEY = (
    f"CREATE OR REPLACE TRIGGER recoverypoint_binds_new_key AFTER INSERT ON {DISTRIBUTED} "
    f"FOR EACH ROW EXECUTE FUNCTION recoverypoint_binds_new_key()"
)
# Whether the keys have that trigger (an older release's engine bound a new key with a
# statement of its own, which this one no longer sends): the engine and the workers refuse
# to run phases on distributed keys without it.
NEW_KEYS_BOUND = f"""
    SELECT EXISTS (
        SELECT FROM pg_trigger
        WHERE tgrelid = CAST('{DISTRIBUTED}' AS regclass)
          AND tgname = 'recoverypoint_binds_new_key'
    )
"""
TRIGGER_MISSING = (
    "idempotency_keys is distributed by Citus without this release's trigger "
    "recoverypoint_binds_new_key (it binds a new key's first atomic phase to its scope's "
    "worker): run `recoverypoint migrate --citus` on the coordinator (it is safe to run "
    "again)"
)
# Citus refuses a trigger on a distributed table unless told the trigger is safe (each
# writes no table, and reads on the shard's own worker).
_TRIGGERS_ALLOWED = "SET LOCAL citus.enable_unsafe_triggers = on"
_TRIGGERS = (STAYS_IN_SCOPE_FUNCTION, STAYS_IN_SCOPE, BINDS_NEW_KEY_FUNCTION, BINDS_NEW_KEY)

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
    out += ["BEGIN;", f"{_TRIGGERS_ALLOWED};"]
    out += [f"{statement.strip()};" for statement in _TRIGGERS]
    out += ["COMMIT;"]
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


# Several instances may run `migrate --citus` at start-up at once, as they run `migrate`:
# each transaction here first takes the lock the migrations take (migrations/env.py), so
# that the first does the work and the others find it done. Without it two of them replaced
# the trigger's function at once, and one failed ("tuple concurrently updated").
_ONE_AT_A_TIME = sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))")


@contextmanager
def _alone(db: sa.Engine) -> Iterator[sa.Connection]:
    with db.begin() as conn:
        conn.execute(_ONE_AT_A_TIME, {"name": VERSION_TABLE})
        yield conn


def distribute(db: sa.Engine, colocate: Sequence[str] = ()) -> list[str]:
    """Distribute the tables (see the module's docstring) on the Citus coordinator ``db``;
    returns the tables it placed this time. Raises :class:`ConfigurationError` on a
    database without Citus, :class:`ValueError` for a bad ``colocate`` entry."""
    wanted = [parse_colocated(spec) for spec in colocate]
    require_citus(db)
    placed: list[str] = []
    with _alone(db) as conn:
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
    # A transaction of its own: Citus creates a function on every node over one connection
    # per node, which the distribution's parallel copies leave none of.
    with _alone(db) as conn:
        for statement in (_TRIGGERS_ALLOWED, *_TRIGGERS):
            conn.exec_driver_sql(statement)
    return placed


def make_reference(db: sa.Engine, tables: Sequence[str]) -> list[str]:
    """Make the application's ``tables`` reference tables on the Citus coordinator ``db``
    (before :func:`distribute` co-locates a table with a foreign key onto one of them);
    returns those it placed this time: one placed already is left alone."""
    for table in tables:
        if _NAME.fullmatch(table) is None:
            raise ValueError(f"not a table name: {table!r}")
    require_citus(db)
    with _alone(db) as conn:
        return _make_reference(conn, tables)


def _make_reference(conn: sa.Connection, tables: Sequence[str]) -> list[str]:
    placed = []
    for table in tables:
        if conn.execute(_PLACED, {"t": table}).scalar_one_or_none() is None:
            conn.execute(_REFERENCE, {"t": table})
            placed.append(table)
    return placed
