"""A request cancelled twice while its claim COMMITs: psycopg closes the connection on the
second interruption, and the server commits all the same. The cleanup must give up the
lease of the key that COMMIT made, and so must see the COMMIT's outcome first: a release
sent on another connection while the COMMIT is still under way finds no row, and the key
stays leased (409 to every retry) until its lock_timeout.

The COMMIT is held on the server by a deferred trigger that waits for an advisory lock the
test holds, and that lets a cancel request pass it by (one arriving then is too late to stop
a COMMIT): every step is waited for as the server reports it, never timed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import recoverypoint as rp

HOLD = 4242

HELD_COMMIT = f"""
CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        BEGIN
            PERFORM pg_advisory_xact_lock_shared({HOLD});
            RETURN NULL;
        EXCEPTION WHEN query_canceled THEN
            NULL;  -- a cancel that lands on COMMIT does not stop it
        END;
    END LOOP;
END $$;
CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON idempotency_keys
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.scope = 'held')
    EXECUTE FUNCTION hold_commit();
"""

WAITING = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = %s
"""


async def until(condition: Callable[[], bool]) -> None:
    """Wait for what the server reports; the bound only turns a hang into a failure."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never reported it")


def test_a_claim_cancelled_twice_at_commit_leaves_no_lease(worker_database_url: str) -> None:
    plain = worker_database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as admin:
        admin.execute(HELD_COMMIT)
        admin.execute("SELECT pg_advisory_lock(%s)", (HOLD,))

        def waiting_on(event: str) -> bool:
            return bool(admin.execute(WAITING, (event,)).fetchone()[0])  # type: ignore[index]

        async def main() -> None:
            engine = rp.AsyncEngine(worker_database_url)
            op: rp.Operation[Any] = rp.Operation("held")

            @op.foreign_step("called")
            async def call(step: rp.StepContext, params: Any) -> None:
                return None

            @op.atomic_phase("finished")
            async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
                return rp.Response(200)

            engine.register(op)
            try:
                task = asyncio.ensure_future(engine.run(op, key="k", scope="held", params={}))
                await until(lambda: waiting_on("advisory"))  # the claim's COMMIT is held
                task.cancel()
                for _ in range(5):  # psycopg takes the cancellation, asks the server to cancel
                    await asyncio.sleep(0)
                task.cancel()  # again: psycopg closes the connection; the server goes on
                # The cleanup ran (and returned) or waits for the COMMIT's outcome.
                await until(lambda: task.done() or waiting_on("transactionid"))
                admin.execute("SELECT pg_advisory_unlock(%s)", (HOLD,))
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                await engine.dispose()

        asyncio.run(main())
    db = sa.create_engine(worker_database_url)
    try:
        with db.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT recovery_point, locked_at, attempts FROM idempotency_keys "
                    "WHERE scope = 'held'"
                )
            ).one()
    finally:
        db.dispose()
    assert (row.recovery_point, row.locked_at, row.attempts) == ("started", None, 1)
