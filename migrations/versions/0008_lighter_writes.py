"""lighter writes: no unique index on a staged job's key, no length checks on the key row

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

What every fresh request paid for at the server, and what nothing needed:

- ``staged_jobs_job_key_key``, the unique index on ``staged_jobs.job_key``. No statement
  looks a job up by its key. The key is derived from the key record and the job's place in
  the phase that staged it, and that phase commits once per key (fenced), so two staged
  rows never share one; a consumer dedupes on it with ``consume_once`` all the same. Every
  staged job entered the index at a random leaf (the key is a hash): about 190 bytes of
  WAL and a sixth of the finish's time per request.
- ``idempotency_keys_key_length`` and ``idempotency_keys_scope_length``. The engine refuses
  a key or scope outside those limits before anything is stored (``recoverypoint.keys``),
  and its claim is the only statement that inserts a key row. PostgreSQL compiles every
  CHECK constraint of a table again for each statement that writes a row of it (three per
  fresh request here): the four of them took about a tenth of the request's statement time
  at the server. The two that keep a finished row whole (``idempotency_keys_finished``,
  ``idempotency_keys_abandoned_finished``) stay.

Dropping an index or a constraint takes a brief exclusive lock and reads nothing.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.drop_constraint("staged_jobs_job_key_key", "staged_jobs", type_="unique")
    op.drop_constraint("idempotency_keys_key_length", "idempotency_keys", type_="check")
    op.drop_constraint("idempotency_keys_scope_length", "idempotency_keys", type_="check")


def downgrade() -> None:
    # Restoring the unique index fails if two staged jobs share a key, as it should.
    op.create_unique_constraint("staged_jobs_job_key_key", "staged_jobs", ["job_key"])
    op.create_check_constraint(
        "idempotency_keys_key_length",
        "idempotency_keys",
        "char_length(idempotency_key) BETWEEN 1 AND 255",
    )
    op.create_check_constraint(
        "idempotency_keys_scope_length", "idempotency_keys", "char_length(scope) <= 255"
    )
