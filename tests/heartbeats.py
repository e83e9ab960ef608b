"""A foreign system that does not dedupe (email, SMS, a webhook), and an operation that
calls it, for tests/test_heartbeat.py and the child process it kills
(tests/heartbeat_child.py): every call sends, so two attempts running one step side by
side show as two rows. Each call is a row in its own autocommit connection, with the
downstream key it was handed and the database's time."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

import recoverypoint as rp

LEASE = 1.0
"""The operations' lock timeout, in seconds: short, so that the tests outlast it quickly."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS heartbeat_sends (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope text NOT NULL,
    downstream_key text NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


class Mailer:
    """Sends every time it is called. Its first call, once it has sent, waits for
    :attr:`gate` (the test's), and tells the test it is waiting (:attr:`calling`)."""

    def __init__(self, db: sa.Engine) -> None:
        self.db = db.execution_options(isolation_level="AUTOCOMMIT")
        self.calling = threading.Event()
        self.gate = threading.Event()
        self.steps: list[rp.StepContext] = []
        self._lock = threading.Lock()

    def send(self, step: rp.StepContext, scope: str) -> dict[str, Any]:
        with self.db.connect() as conn:
            conn.execute(
                sa.text("INSERT INTO heartbeat_sends (scope, downstream_key) VALUES (:s, :k)"),
                {"s": scope, "k": step.downstream_key()},
            )
        with self._lock:
            first = not self.steps
            self.steps.append(step)
        if first:
            self.calling.set()
            self.gate.wait(120)  # the test opens it; a failed one must not hang
        return {"lost": step.lease_lost}


def operation(kind: str, mailer: Mailer) -> rp.Operation[Any]:
    """begun (atomic) → sent (the mailer, a foreign step) → done (atomic, 201); ``kind``:
    ``sync`` for rp.Engine, ``async`` for rp.AsyncEngine."""
    op: rp.Operation[Any] = rp.Operation("notify", lock_timeout=timedelta(seconds=LEASE))
    if kind == "sync":

        @op.atomic_phase("begun")
        def begin(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
            return None

        @op.foreign_step("sent")
        def send(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
            return mailer.send(step, params["scope"])

        @op.atomic_phase("done")
        def done(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
            return rp.Response(201, dict(tx.state))

    else:

        @op.atomic_phase("begun")
        async def abegin(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> None:
            return None

        @op.foreign_step("sent")
        async def asend(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
            return await asyncio.to_thread(mailer.send, step, params["scope"])

        @op.atomic_phase("done")
        async def adone(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> rp.Response:
            return rp.Response(201, dict(tx.state))

    return op
