"""no row checks: what keeps a finished key row whole is checked by doctor, not by every write

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30

Drops the last two CHECK constraints of ``idempotency_keys``, which migration 0008 kept:

- ``idempotency_keys_finished``: ``(finished_at IS NULL) = (response_status IS NULL)``;
- ``idempotency_keys_abandoned_finished``: ``abandoned_at IS NULL OR finished_at IS NOT NULL``.

PostgreSQL parses and plans every CHECK constraint of a table again for each statement that
writes a row of it, whichever columns the statement sets. A fresh request writes its key
row three times (the claim, the write that records its first phase, the one that finishes
it), and the two checks cost 7 % of the server's instructions for the whole request
(``benchmarks/server_instructions.py``: 1,340k without this revision, 1,253k with it).

What they kept still holds, and is still checked:

- Five statements set those columns, and each sets them together: the engine's finish and
  a client's abandonment of a key out of attempts (``recoverypoint.engine.sql``), the
  completer's abandonment of one, and the operator's abandon and reopen
  (``recoverypoint.admin.key_actions``). No other statement of recoverypoint writes them.
  The finish stores the status of the phase's Response, which the engine refuses unless
  it is an HTTP status (``recoverypoint.keys.is_http_status``): the constraint refused a
  ``None`` there.
- ``recoverypoint doctor`` counts the rows that break either rule, in the scan of every key
  it makes anyway, and fails when it finds one (``recoverypoint.admin.keys.BROKEN``).
- The test suite checks every database it used, at its end, for such rows.

Dropping a constraint takes a brief exclusive lock and reads nothing: keys in flight are
untouched. On 1,001,000 keys (1,000 of them in flight), a writer updating a key row in a
loop during the upgrade waited 12 ms at most. The downgrade adds them back, which reads
every row under that lock (the same writer waited 433 ms there) and fails if a row breaks
either rule, as it should.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.drop_constraint("idempotency_keys_finished", "idempotency_keys", type_="check")
    op.drop_constraint("idempotency_keys_abandoned_finished", "idempotency_keys", type_="check")


def downgrade() -> None:
    op.create_check_constraint(
        "idempotency_keys_finished",
        "idempotency_keys",
        "(finished_at IS NULL) = (response_status IS NULL)",
    )
    op.create_check_constraint(
        "idempotency_keys_abandoned_finished",
        "idempotency_keys",
        "abandoned_at IS NULL OR finished_at IS NOT NULL",
    )
