"""worker pass interval: how often each worker said it would pass, so that a stopped one
shows as late after a few of its own intervals

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25

- ``worker_passes.interval_seconds``: the interval plus jitter, in seconds, the worker runs
  its passes at, written with each pass. The console's overview and ``recoverypoint
  doctor`` call a worker late after three of them and half a minute (a long pass delays
  the next record); a worker stopped a minute ago no longer shows as fresh for five.
  Rows written before this revision, by a process still running the previous release, or
  by a single pass (``--once``) have none: they are judged as before, late after 300 s.

Adding a nullable column without a default rewrites nothing.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("worker_passes", sa.Column("interval_seconds", sa.Float(precision=53)))


def downgrade() -> None:
    op.drop_column("worker_passes", "interval_seconds")
