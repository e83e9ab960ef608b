"""operator retries: when an operator last made a key due, so that the completer takes it
on its next pass

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29

- ``idempotency_keys.retried_at``: when ``recoverypoint keys retry`` (or the console's
  retry) last made the key due. A completer takes a key retried since its last run on its
  next pass, whatever its ``min_age`` (the time a key is left to its own client): the
  operator has decided for the client. The next run (``last_run_at``) ends it; a key that
  fails again waits for its client as before. Rows retried before this revision, or by a
  process of the previous release, have none: they wait out ``min_age`` as before.

Adding a nullable column without a default rewrites nothing.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("retried_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("idempotency_keys", "retried_at")
