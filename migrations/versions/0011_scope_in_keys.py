"""scope in every key: the tables keyed by request can be distributed (or partitioned) by
scope, and a phase's transaction is recognised by a token rather than its transaction id

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25

Citus distributes a table by one column and refuses a primary key or unique constraint
that leaves it out; PostgreSQL's partitioned tables have the same rule. ``scope`` is that
column (the tenant), so:

- ``idempotency_keys``: primary key ``(id, scope)`` (was ``(id)``); the unique constraint
  on ``(idempotency_key, scope, operation)`` has it already. The id first: a lookup by id
  alone (an operator's tools) still finds its row through the key, and new ids still
  append at the right edge of the index as before.
- ``staged_jobs``: a ``scope`` column, the scope of the key that staged the job, filled in
  from that key for the jobs already staged (a job whose key is gone, reaped or deleted by
  an operator, gets ``''``), then ``NOT NULL``; primary key ``(id, scope)``. With it the
  table is co-located with ``idempotency_keys``, and a phase's jobs are inserted on the
  shard of its key.
- ``recoverypoint_write_missed(in_phase boolean)``: what the statement recording a phase
  calls when it misses its row, as 0007's ``recoverypoint_write_missed(began text)`` was,
  told whether the statement still runs in the phase's transaction. The engine now knows
  that by the transaction's token (a setting local to the transaction, ``recoverypoint.tx``,
  that the engine gives each transaction it begins), which the statement reads where it is
  sent: on Citus the coordinator, whereas a transaction id is read on the worker by one
  statement and on the coordinator by another, and never matches. 0007's function stays,
  unchanged, for a process of the previous release still running during the upgrade.

How long it locks. Each primary key is rebuilt: ``ADD PRIMARY KEY`` builds a unique index
under an ACCESS EXCLUSIVE lock on the table, reading every row (about a second per
million keys on ordinary hardware); filling ``staged_jobs.scope`` rewrites each staged
row, and ``SET NOT NULL`` reads the table once more. ``staged_jobs`` holds only what the
enqueuer has not published yet, so that is short; on a large ``idempotency_keys`` the
index build is the wait. The lock-free path, for a large table, is to build the index
first without blocking writes, before running this revision::

    CREATE UNIQUE INDEX CONCURRENTLY idempotency_keys_scope_id
        ON idempotency_keys (id, scope);

This revision then turns that index into the primary key (``ADD PRIMARY KEY USING
INDEX``), which takes the lock only for a moment. Keys in flight are untouched: no value
changes, and a request that holds a lease keeps it across the upgrade.

An application's own foreign keys onto ``idempotency_keys (id)`` keep working: when there
are any, a unique constraint on ``id`` alone (``idempotency_keys_id_key``) is kept for them,
and each is re-created against it (``NOT VALID``, then validated, which reads the
referencing table without blocking its writes). Such a key cannot be distributed on Citus
(``recoverypoint migrate --citus`` says so): reference ``(id, scope)`` there, or nothing.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None

_PREBUILT = "idempotency_keys_scope_id"


# The foreign keys of other tables onto idempotency_keys (id), kept across the swap of the
# primary key: each dropped, then made again against a unique constraint on id alone.
_KEEP_FOREIGN_KEYS = """
    CREATE TEMPORARY TABLE recoverypoint_foreign_keys ON COMMIT DROP AS
    SELECT conrelid::regclass::text AS tab, conname AS name, pg_get_constraintdef(oid) AS def
    FROM pg_constraint
    WHERE contype = 'f' AND confrelid = 'idempotency_keys'::regclass;

    DO $$
    DECLARE fk record;
    BEGIN
        FOR fk IN SELECT * FROM recoverypoint_foreign_keys LOOP
            EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', fk.tab, fk.name);
        END LOOP;
    END
    $$;
"""

_RESTORE_FOREIGN_KEYS = """
    DO $$
    DECLARE fk record;
    BEGIN
        IF EXISTS (SELECT FROM recoverypoint_foreign_keys) THEN
            ALTER TABLE idempotency_keys
                ADD CONSTRAINT idempotency_keys_id_key UNIQUE (id);
        END IF;
        FOR fk IN SELECT * FROM recoverypoint_foreign_keys LOOP
            EXECUTE format('ALTER TABLE %s ADD CONSTRAINT %I %s NOT VALID',
                           fk.tab, fk.name, fk.def);
            EXECUTE format('ALTER TABLE %s VALIDATE CONSTRAINT %I', fk.tab, fk.name);
        END LOOP;
    END
    $$;
"""


def upgrade() -> None:
    op.execute(_KEEP_FOREIGN_KEYS)
    op.drop_constraint("idempotency_keys_pkey", "idempotency_keys", type_="primary")
    # Built beforehand, CONCURRENTLY, on a large table (see above): made the key at once.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF to_regclass('{_PREBUILT}') IS NOT NULL THEN
                ALTER TABLE idempotency_keys
                    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY USING INDEX {_PREBUILT};
            ELSE
                ALTER TABLE idempotency_keys
                    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (id, scope);
            END IF;
        END
        $$
        """
    )
    op.execute(_RESTORE_FOREIGN_KEYS)

    op.add_column("staged_jobs", sa.Column("scope", sa.Text))
    op.execute(
        """
        UPDATE staged_jobs AS j
        SET scope = coalesce(
            (SELECT k.scope FROM idempotency_keys AS k WHERE k.id = j.idempotency_key_id), '')
        """
    )
    op.alter_column("staged_jobs", "scope", nullable=False)
    op.drop_constraint("staged_jobs_pkey", "staged_jobs", type_="primary")
    op.create_primary_key("staged_jobs_pkey", "staged_jobs", ["id", "scope"])

    op.execute(
        """
        CREATE FUNCTION recoverypoint_write_missed(in_phase boolean) RETURNS boolean
        LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            IF in_phase IS NOT TRUE THEN
                RAISE EXCEPTION 'recoverypoint: the phase ended the transaction it began in'
                    USING ERRCODE = 'RP002';
            END IF;
            RAISE EXCEPTION 'recoverypoint: the key row changed under the phase'
                USING ERRCODE = 'RP001';
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION recoverypoint_write_missed(boolean)")
    op.drop_constraint("staged_jobs_pkey", "staged_jobs", type_="primary")
    op.create_primary_key("staged_jobs_pkey", "staged_jobs", ["id"])
    op.drop_column("staged_jobs", "scope")
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_id_key")
    op.drop_constraint("idempotency_keys_pkey", "idempotency_keys", type_="primary")
    op.create_primary_key("idempotency_keys_pkey", "idempotency_keys", ["id"])
