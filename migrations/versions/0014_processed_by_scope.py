"""consume-once records by scope: on Citus they commit where the job's scope lives

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30

``processed_messages`` gets a ``scope`` column, the scope of the job the consumer
processed (``consume_once(..., scope=job.scope)``), and an index on ``(scope,
processed_at)`` for the reaper, which prunes the records scope by scope. The primary key
stays ``(consumer, message_id)``: the previous release's consumers insert with ``ON
CONFLICT (consumer, message_id)``, which needs a unique index on exactly those columns,
so they keep working on this schema (migrate before you deploy). This release's consumers
insert with ``ON CONFLICT DO NOTHING``, which works under either key.

On Citus the table was a reference table, copied to every node, so every consumed job
committed on every node by two-phase commit, and a consumer cost more the larger the
cluster. ``recoverypoint migrate --citus`` (``recoverypoint.distribute``) makes the primary
key ``(consumer, message_id, scope)`` (Citus needs the distribution column in it) and
distributes the table by scope, co-located with the keys and their jobs: a consumer's
record commits on its scope's worker, with the consumer's own writes to that scope's rows.
From then on the previous release's insert fails, so its consumers must be gone before.

The records already there, and those that a process of the previous release writes during
the upgrade, get ``''`` (the column's default): the scope of a consumer that passes none,
which finds them as before. On one server a message is recognised under any scope (the key
has none); on Citus only under the scope it was recorded with: a consumer there that starts
passing its jobs' scopes does not find the records it wrote without one, and processes a
message it consumed before again if it is delivered again. Start passing the scope where
that cannot happen (a consumer whose messages are not redelivered once it has committed, or
once the records written without it are past the reaper's ``processed_retention``).

How long it locks. Adding a column with a constant default rewrites nothing; building the
index reads every record (the reaper keeps them 7 days by default) under a lock that makes
consumers wait. For a large table, build it first without blocking writes, before running
this revision, which then finds it and keeps it::

    CREATE INDEX CONCURRENTLY processed_messages_scope_processed_at
        ON processed_messages (scope, processed_at);

(It needs the column: add it first with the ``ALTER TABLE`` below, which takes its lock
only for a moment. An index that ``CONCURRENTLY`` failed to build is left invalid: drop it
and build it again.)

Downgrade. It keeps one record per consumer and message, the one of the lowest scope
(``''`` if any), deleting the others while the key still finds them, then drops the column
with the key and the index that hold it, and restores the primary key ``(consumer,
message_id)`` if it was the one ``migrate --citus`` replaced. On a Citus table distributed
by scope it is not possible: Citus does not drop the distribution column. Undistribute the
table first (``SELECT undistribute_table('processed_messages')``).

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS scope text NOT NULL DEFAULT ''"
    )
    # Built beforehand, CONCURRENTLY, on a large table (see above): kept as it is.
    op.execute(
        "CREATE INDEX IF NOT EXISTS processed_messages_scope_processed_at "
        "ON processed_messages (scope, processed_at)"
    )


def downgrade() -> None:
    # Before the key is dropped: it is what finds each record's twins.
    op.execute(
        """
        DELETE FROM processed_messages AS p
        WHERE EXISTS (SELECT FROM processed_messages AS q
                      WHERE q.consumer = p.consumer AND q.message_id = p.message_id
                        AND q.scope < p.scope)
        """
    )
    # Drops the index and, after migrate --citus, the primary key with the column.
    op.drop_column("processed_messages", "scope")
    op.execute(
        """
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_constraint
                           WHERE conrelid = 'processed_messages'::regclass AND contype = 'p')
            THEN
                ALTER TABLE processed_messages
                    ADD CONSTRAINT processed_messages_pkey PRIMARY KEY (consumer, message_id);
            END IF;
        END
        $$
        """
    )
