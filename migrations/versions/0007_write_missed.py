"""the error a phase's recording write raises when it misses its row

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

- ``recoverypoint_write_missed(began text)``: called by the statement that records an
  atomic phase (its recovery point, state, response and staged jobs) when that statement
  found no row to write, it raises instead of returning nothing:

  - ``RP002`` when the transaction is no longer the one the phase began in (phase code
    ended it and began another),
  - ``RP001`` otherwise (the key row changed under the phase).

  The engine sends COMMIT in the same message as that statement; an error there aborts
  the transaction, so the phase's writes are never committed without their recovery point.

Written out in full, like 0001: a revision must not change when the schema module does.
"""

from __future__ import annotations

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION recoverypoint_write_missed(began text) RETURNS boolean
        LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            IF pg_current_xact_id()::text IS DISTINCT FROM began THEN
                RAISE EXCEPTION 'recoverypoint: the phase ended the transaction it began in'
                    USING ERRCODE = 'RP002';
            END IF;
            RAISE EXCEPTION 'recoverypoint: the key row changed under the phase'
                USING ERRCODE = 'RP001';
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute("DROP FUNCTION recoverypoint_write_missed(text)")
