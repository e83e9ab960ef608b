"""what an operator's tools need to judge a key on their own: its lease's timeout, and a
secret to mask values with

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25

- ``idempotency_keys.lock_timeout``: the lock timeout, in seconds, of the request that
  holds the key's lease, written by every claim. ``keys release`` or the console judge a
  lease by it: without it they had only the operations they were told about, and a default
  of 90 seconds for the rest, which called a ten-minute lease expired after a minute and a
  half. Rows claimed before this revision (or by a process still running the previous
  release) have none; the operator's tools then judge by the operation they know, and a
  lease they cannot judge is live.
- ``installation_secrets``: one random secret per database, made by the server, that
  masked values are keyed with (``recoverypoint.admin.mask``). An unkeyed digest of a
  value can be brute-forced back to it (an amount, a PIN); a keyed one cannot without the
  secret, which no page shows.

Adding a nullable column without a default rewrites nothing; the secret is one row.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import BYTEA

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("lock_timeout", sa.Float(precision=53)))
    op.create_table(
        "installation_secrets",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("secret", BYTEA, nullable=False),
    )
    # 32 bytes from two version-4 UUIDs (244 random bits, from the server's strong random
    # source): made by the server, so that `migrate --sql` never prints a secret.
    op.execute(
        "INSERT INTO installation_secrets (name, secret) VALUES ('mask', decode("
        "replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))"
    )


def downgrade() -> None:
    op.drop_table("installation_secrets")
    op.drop_column("idempotency_keys", "lock_timeout")
