"""What the metrics and tracing tests share: an operation whose phase meets a real
serialization failure, on demand, and a Rocket Rides engine on a worker database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

import recoverypoint as rp


def conflicting_operation(name: str, db: sa.Engine, conflicts: list[int]) -> rp.Operation[Any]:
    """prepared (atomic) → bumped (atomic): ``bumped`` reads a counter, and while
    ``conflicts[0]`` is above 0 another connection updates it and commits before the
    phase's own update does; SERIALIZABLE then fails the phase with a real 40001."""
    op: rp.Operation[Any] = rp.Operation(name)
    other = db.execution_options(isolation_level="AUTOCOMMIT")

    @op.atomic_phase("prepared")
    def prepare(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.execute("INSERT INTO counters (name, n) VALUES (%s, 0) ON CONFLICT DO NOTHING", (name,))

    @op.atomic_phase("bumped")
    def bump(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.execute("SELECT n FROM counters WHERE name = %s", (name,)).fetchone()
        if conflicts[0] > 0:
            conflicts[0] -= 1
            with other.connect() as conn:
                conn.execute(sa.text("UPDATE counters SET n = n + 1 WHERE name = :n"), {"n": name})
        tx.execute("UPDATE counters SET n = n + 1 WHERE name = %s", (name,))
        return rp.Response(200, {"bumped": True})

    return op
