"""one index on the client's key: the unique constraint leads with it

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

- ``idempotency_keys_scope_operation_key`` now orders its columns ``idempotency_key,
  scope, operation``. The claim and the replay look a key up by all three, which either
  order serves; a search by the client's key alone (``idempotency_keys_key`` of 0005) is
  now served by this index's first column, so that index is dropped.
  Every new key and every finish wrote an entry into both indexes; each of them lands on a
  random leaf page (keys are random), which after a checkpoint costs a whole page of WAL.
  The constraint keeps its name and its columns (``ON CONFLICT (scope, operation,
  idempotency_key)`` still names it), and ``scope`` is still in it.

Building the new index reads the whole table and blocks writes to it meanwhile (as
``CREATE UNIQUE INDEX`` does); on a large table, run it when the traffic is low.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

_CONSTRAINT = "idempotency_keys_scope_operation_key"


def upgrade() -> None:
    _replace_unique_constraint(("idempotency_key", "scope", "operation"))
    op.drop_index("idempotency_keys_key", table_name="idempotency_keys")


def downgrade() -> None:
    op.create_index("idempotency_keys_key", "idempotency_keys", ["idempotency_key"])
    _replace_unique_constraint(("scope", "operation", "idempotency_key"))


def _replace_unique_constraint(columns: tuple[str, ...]) -> None:
    # The new index is built first, so that no moment passes without a unique one.
    op.create_index(f"{_CONSTRAINT}_new", "idempotency_keys", list(columns), unique=True)
    op.drop_constraint(_CONSTRAINT, "idempotency_keys", type_="unique")
    op.execute(
        f"ALTER TABLE idempotency_keys ADD CONSTRAINT {_CONSTRAINT} "
        f"UNIQUE USING INDEX {_CONSTRAINT}_new"
    )
