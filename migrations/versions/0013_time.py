"""time: attempts counted at the claim, key generations, providers' windows, compensation

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29

Each guarantee depended on a window nobody declared. This revision gives the rows what the
rules about time need:

- ``idempotency_keys.generation``: how many times the key (scope, operation, key) was used
  before this request and deleted after its retention. Part of what every key derived for
  the request is made from, so that a key reused after its retention hands the provider new
  downstream keys, while a row lost in a failover is claimed again with the same
  generation (recoverypoint.keys.key_seed).
- ``key_generations``: the next generation of each key whose finished row was deleted (by
  the reaper, or by the claim of a reuse past the retention), written in the transaction
  that deletes the row. It outlives the row, so a reuse after reaping is a new generation
  too; the reaper prunes it after the generations' retention.
- ``idempotency_keys.point_reached_at``: when the recovery point was committed, so when
  the foreign step after it was first called at the earliest. A step that declares its
  provider's dedupe window is never called blindly again once the window has passed.
  NULL in rows written before this revision: they are judged from ``created_at``.
- ``idempotency_keys.window_renewals``: how many times the step after the recovery point
  was called anew, with a fresh downstream key, after its provider had forgotten the old
  one (reconciliation found nothing). 0 when the point moves on.
- ``idempotency_keys.reconcile_since``: when a run found the step after the recovery point
  past its provider's window with nothing to ask the provider: the key waits for an
  operator's reconciliation, and no worker takes it meanwhile.
- ``idempotency_keys.compensated_at``: when the operation's compensation committed for an
  abandoned key (it runs once).
- ``idempotency_keys.compensation_due_at``: when the completer may next run the
  compensation of an abandoned key, if its operation declares one: set by every
  abandonment, pushed back by a failed compensation, cleared once it commits or the key
  is reopened. NULL: none awaited (keys abandoned before this revision among them). The
  partial index ``idempotency_keys_compensation_due`` holds only the keys it is set on, by
  operation and version first, so that the completer's search reads only the keys of the
  operations that declare a compensation, not every abandoned key.
- ``idempotency_keys.compensation_attempts``: how many times the compensation raised; the
  back-off before the next try grows with it.

Adding a nullable column, or one with a constant default, rewrites nothing; the new
partial index is empty until a key is abandoned.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column(
        "idempotency_keys",
        sa.Column("generation", sa.Integer, nullable=False, server_default=sa.text("0")),
    )
    op.add_column("idempotency_keys", sa.Column("point_reached_at", sa.DateTime(timezone=True)))
    op.add_column(
        "idempotency_keys",
        sa.Column("window_renewals", sa.Integer, nullable=False, server_default=sa.text("0")),
    )
    op.add_column("idempotency_keys", sa.Column("reconcile_since", sa.DateTime(timezone=True)))
    op.add_column("idempotency_keys", sa.Column("compensated_at", sa.DateTime(timezone=True)))
    op.add_column(
        "idempotency_keys", sa.Column("compensation_due_at", sa.DateTime(timezone=True))
    )
    op.add_column(
        "idempotency_keys",
        sa.Column(
            "compensation_attempts", sa.Integer, nullable=False, server_default=sa.text("0")
        ),
    )
    op.create_index(
        "idempotency_keys_compensation_due",
        "idempotency_keys",
        ["operation", "operation_version", "compensation_due_at"],
        postgresql_where=sa.text("compensation_due_at IS NOT NULL"),
    )
    op.create_table(
        "key_generations",
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("operation", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column(
            "deleted_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.PrimaryKeyConstraint(
            "idempotency_key", "scope", "operation", name="key_generations_pkey"
        ),
    )
    op.create_index("key_generations_deleted_at", "key_generations", ["deleted_at"])


def downgrade() -> None:
    op.drop_index("key_generations_deleted_at", table_name="key_generations")
    op.drop_table("key_generations")
    op.drop_index("idempotency_keys_compensation_due", table_name="idempotency_keys")
    for column in (
        "compensation_attempts",
        "compensation_due_at",
        "compensated_at",
        "reconcile_since",
        "window_renewals",
        "point_reached_at",
        "generation",
    ):
        op.drop_column("idempotency_keys", column)
