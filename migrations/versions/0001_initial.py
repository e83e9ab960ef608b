"""idempotency_keys and staged_jobs

Revision ID: 0001
Revises:
Create Date: 2025-11-21

Written out in full rather than built from recoverypoint.schema: a revision is a frozen
record of what it did, and must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), primary_key=True),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("operation", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("operation_version", sa.Integer(), nullable=False),
        sa.Column("request_method", sa.Text(), nullable=False),
        sa.Column("request_path", sa.Text(), nullable=False),
        sa.Column("request_params", postgresql.JSONB(), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("recovery_point", sa.Text(), nullable=False, server_default=sa.text("'started'")),
        sa.Column(
            "state", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")
        ),
        sa.Column("locked_at", sa.DateTime(timezone=True)),
        sa.Column("lock_token", postgresql.UUID(as_uuid=True)),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column(
            "next_attempt_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("last_error", sa.Text()),
        sa.Column("response_status", sa.Integer()),
        sa.Column("response_headers", postgresql.JSONB()),
        sa.Column("response_body", postgresql.JSONB()),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "last_run_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint(
            "scope", "operation", "idempotency_key", name="idempotency_keys_scope_operation_key"
        ),
        sa.CheckConstraint(
            "char_length(idempotency_key) BETWEEN 1 AND 255", name="idempotency_keys_key_length"
        ),
        sa.CheckConstraint("char_length(scope) <= 255", name="idempotency_keys_scope_length"),
        sa.CheckConstraint(
            "(finished_at IS NULL) = (response_status IS NULL)", name="idempotency_keys_finished"
        ),
    )
    op.create_index(
        "idempotency_keys_unfinished",
        "idempotency_keys",
        ["next_attempt_at"],
        postgresql_where=sa.text("finished_at IS NULL"),
    )
    op.create_index(
        "idempotency_keys_finished_at",
        "idempotency_keys",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )

    op.create_table(
        "staged_jobs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), primary_key=True),
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("job_args", postgresql.JSONB(), nullable=False),
        sa.Column("job_key", sa.Text(), nullable=False, unique=True),
        # Not a foreign key, on purpose: see recoverypoint.schema.
        sa.Column("idempotency_key_id", sa.BigInteger()),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
    )
    op.create_index("staged_jobs_idempotency_key_id", "staged_jobs", ["idempotency_key_id"])


def downgrade() -> None:
    # Dropping a table drops its indexes and constraints with it.
    op.drop_table("staged_jobs")
    op.drop_table("idempotency_keys")
