"""console: the audit table of operator actions, and the index a search by key needs

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

- ``audit_log``: one row per operator action (retry, release, abandon, reopen, delete,
  purge of keys; retry and delete of staged jobs), from ``recoverypoint keys|jobs``, the
  web console or ``recoverypoint.admin``: who (``actor``, and ``via`` which surface), what
  (``action`` and its options in ``details``), when (``at``, the database's clock) and
  which rows (``ids``: the rows it changed, keys or staged jobs; ``matched``: how many
  it selected).
  Written in the action's own transaction, so a change is never without its record.
- ``idempotency_keys_key``: a key found by the client's idempotency key alone (a support
  ticket quotes it; the scope is masked), without reading the whole table.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("via", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("matched", sa.Integer(), nullable=False),
        sa.Column("ids", postgresql.ARRAY(sa.BigInteger()), nullable=False),
        sa.Column(
            "details",
            postgresql.JSONB(),
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("idempotency_keys_key", "idempotency_keys", ["idempotency_key"])


def downgrade() -> None:
    op.drop_index("idempotency_keys_key", table_name="idempotency_keys")
    op.drop_table("audit_log")
