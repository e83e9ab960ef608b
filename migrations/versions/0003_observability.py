"""observability: the trace context of staged jobs, an index for the abandoned-keys gauge

Revision ID: 0003
Revises: 0002
Create Date: 2026-01-15

- ``staged_jobs.trace_context``: the W3C ``traceparent`` of the phase that staged the job,
  when the engine has a tracing observer; the enqueuer's send span continues that trace,
  and the consumer's span links to it. NULL without one.
- ``idempotency_keys_abandoned``: abandoned keys by operation, partial, so that the
  metrics collector counts them at every scrape without reading every finished key. Only
  abandoned rows are in it, and the engine never writes ``abandoned_at``, so the request
  path's updates stay HOT.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("staged_jobs", sa.Column("trace_context", sa.Text()))
    op.create_index(
        "idempotency_keys_abandoned",
        "idempotency_keys",
        ["operation"],
        postgresql_where=sa.text("abandoned_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("idempotency_keys_abandoned", table_name="idempotency_keys")
    op.drop_column("staged_jobs", "trace_context")
