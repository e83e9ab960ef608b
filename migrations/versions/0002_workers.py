"""workers: abandoned keys, staged-job retries, processed messages

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-21

- ``idempotency_keys.abandoned_at``: set by the completer when it gives a key up. An
  abandoned key is also finished (it carries the error response a retrying client gets
  replayed); the column tells it apart so that the reaper keeps it longer.
- ``staged_jobs.attempts``, ``next_attempt_at``, ``last_error``: a job whose publish failed
  stays staged and waits before the enqueuer tries it again.
- ``processed_messages``: what the consume-once helper records, one row per consumer and
  message id, in the consumer's own transaction.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("abandoned_at", sa.DateTime(timezone=True)))
    op.create_check_constraint(
        "idempotency_keys_abandoned_finished",
        "idempotency_keys",
        "abandoned_at IS NULL OR finished_at IS NOT NULL",
    )

    op.add_column(
        "staged_jobs",
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column(
        "staged_jobs",
        sa.Column(
            "next_attempt_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
    )
    op.add_column("staged_jobs", sa.Column("last_error", sa.Text()))
    op.create_index("staged_jobs_next_attempt_at", "staged_jobs", ["next_attempt_at"])

    op.create_table(
        "processed_messages",
        sa.Column("consumer", sa.Text(), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column(
            "processed_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="processed_messages_pkey"),
    )
    op.create_index("processed_messages_processed_at", "processed_messages", ["processed_at"])


def downgrade() -> None:
    op.drop_table("processed_messages")
    op.drop_index("staged_jobs_next_attempt_at", table_name="staged_jobs")
    for column in ("last_error", "next_attempt_at", "attempts"):
        op.drop_column("staged_jobs", column)
    op.drop_constraint("idempotency_keys_abandoned_finished", "idempotency_keys", type_="check")
    op.drop_column("idempotency_keys", "abandoned_at")
