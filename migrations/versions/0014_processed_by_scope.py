"""consume-once records by scope: on Citus they commit where the job's scope lives

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30

``processed_messages`` gets a ``scope`` column, the scope of the job the consumer
processed (``consume_once(..., scope=job.scope)``), and its primary key becomes
``(consumer, message_id, scope)``. On Citus the table was a reference table, copied to every
node, so every consumed job committed on every node by two-phase commit, and a consumer
cost more the larger the cluster. With the scope in its key, ``recoverypoint migrate
--citus`` distributes it by scope, co-located with the keys and their jobs: a consumer's
record commits on its scope's worker, with the consumer's own writes to that scope's rows.

The records already there, and those that a process of the previous release writes during
the upgrade, get ``''`` (the column's default): the scope of a consumer that passes none,
which finds them as before. A consumer that starts passing its jobs' scopes does not find
the records it wrote without one: a message it consumed before and that is delivered again
after is processed again. Start passing the scope where that cannot happen (a consumer
whose messages are not redelivered once it has committed, or once the records written
without it are past the reaper's ``processed_retention``).

How long it locks. Adding a column with a constant default rewrites nothing; the primary
key is rebuilt: ``ADD PRIMARY KEY`` builds a unique index under an ACCESS EXCLUSIVE lock on
the table, reading every record (the reaper keeps them 7 days by default), and consumers
wait meanwhile. The lock-free path, for a large table, is to add the column and build the
index first without blocking writes, before running this revision::

    ALTER TABLE processed_messages ADD COLUMN scope text NOT NULL DEFAULT '';
    CREATE UNIQUE INDEX CONCURRENTLY processed_messages_scope
        ON processed_messages (consumer, message_id, scope);

This revision then keeps that column and turns that index into the primary key (``ADD
PRIMARY KEY USING INDEX``), which takes the lock only for a moment.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None

_PREBUILT = "processed_messages_scope"


def upgrade() -> None:
    op.execute(
        "ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS scope text NOT NULL DEFAULT ''"
    )
    op.drop_constraint("processed_messages_pkey", "processed_messages", type_="primary")
    # Built beforehand, CONCURRENTLY, on a large table (see above): made the key at once.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF to_regclass('{_PREBUILT}') IS NOT NULL THEN
                ALTER TABLE processed_messages
                    ADD CONSTRAINT processed_messages_pkey PRIMARY KEY USING INDEX {_PREBUILT};
            ELSE
                ALTER TABLE processed_messages
                    ADD CONSTRAINT processed_messages_pkey
                    PRIMARY KEY (consumer, message_id, scope);
            END IF;
        END
        $$
        """
    )


def downgrade() -> None:
    op.drop_constraint("processed_messages_pkey", "processed_messages", type_="primary")
    # One record per consumer and message again: the one without a scope, if any.
    op.execute(
        """
        DELETE FROM processed_messages AS p
        WHERE EXISTS (SELECT FROM processed_messages AS q
                      WHERE q.consumer = p.consumer AND q.message_id = p.message_id
                        AND q.scope < p.scope)
        """
    )
    op.create_primary_key(
        "processed_messages_pkey", "processed_messages", ["consumer", "message_id"]
    )
    op.drop_column("processed_messages", "scope")
