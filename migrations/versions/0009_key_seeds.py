"""key seeds: derived keys that survive the loss of their key row

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

Downstream keys and job keys were derived from the key row's id and creation time. A
failover to a lagging asynchronous standby loses the rows of the last moments; the
client's retry then claims a new row, and the provider, handed a new downstream key,
charged again. From now on they are derived from what the client sent (scope, operation,
key) and the database's namespace:

- ``recoverypoint_namespace``: one row, a random namespace made here, once per database.
  It replicates and is restored with the database, so a promoted standby derives the same
  keys, and two databases (staging and production, two shards) sharing a provider account
  never derive the same ones. ``rp.Engine(namespace=...)`` overrides it.
- ``idempotency_keys.derivation_seed``: the hash of namespace, scope, operation and key
  that every key derived for the row is made from, written by the claim. Rows claimed
  before this revision have none and keep deriving from their id and creation time, so a
  key in flight during the upgrade keeps the downstream keys it already handed out.

Adding a nullable column without a default rewrites nothing and reads nothing.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "recoverypoint_namespace",
        # One row: the primary key can only be true.
        sa.Column("one", sa.Boolean, primary_key=True, server_default=sa.text("true")),
        sa.Column("namespace", sa.Text, nullable=False),
        sa.CheckConstraint("one", name="recoverypoint_namespace_one_row"),
    )
    op.execute("INSERT INTO recoverypoint_namespace (namespace) VALUES (gen_random_uuid()::text)")
    op.add_column("idempotency_keys", sa.Column("derivation_seed", sa.Text))


def downgrade() -> None:
    op.drop_column("idempotency_keys", "derivation_seed")
    op.drop_table("recoverypoint_namespace")
