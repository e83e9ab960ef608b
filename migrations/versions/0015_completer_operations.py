"""completer operations: what each running completer can finish

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29

- ``completer_operations``: one row per completer, written with each of its passes: the
  operation versions its application registers (``operations[i]`` at ``versions[i]``), its
  host and process, when, and how long until its next pass at the latest (NULL for a single
  pass). A completer meeting keys of a version it does not register tells from it whether
  another running completer will finish them or nobody can (an error), and ``recoverypoint
  doctor`` and the console report the keys nobody can, without loading the application.
  The next completer to record deletes the rows of those no longer running: a few rows.

A process of the previous release writes nothing here; a completer of this one then takes
the keys of versions only that process registers for nobody's (an error it logs), until
the previous release is stopped, as upgrading asks.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "completer_operations",
        sa.Column("completer", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("operations", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("versions", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("interval_seconds", sa.Float(precision=53)),
        sa.PrimaryKeyConstraint("completer"),
    )


def downgrade() -> None:
    op.drop_table("completer_operations")
