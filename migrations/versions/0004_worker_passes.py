"""worker passes: when each kind of worker last ran a pass, for ``recoverypoint doctor``

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

- ``worker_passes``: one row per worker kind (completer, enqueuer, reaper) and host,
  written by ``run_forever`` after each pass: when, by which process, and the error of a
  pass that failed (NULL after one that did not). A few rows, updated every few seconds.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "worker_passes",
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column(
            "last_pass_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("last_error", sa.Text()),
        sa.PrimaryKeyConstraint("worker", "host"),
    )


def downgrade() -> None:
    op.drop_table("worker_passes")
