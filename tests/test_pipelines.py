"""Under contention every pipeline, cursor and transaction is closed on every error path:
32 requests doing read-modify-write on one row (serialization failures in the claim, the
phase and the pipelined COMMIT), then psycopg must have said nothing and every pooled
connection must be idle."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa
from rides import count

import recoverypoint as rp
from recoverypoint.database import create_engine


@pytest.mark.slow
def test_contention_leaves_no_pipeline_or_transaction_behind(
    database_url: str, business_tables: None, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    db = create_engine(database_url, pool_size=32, max_overflow=0)
    engine = rp.Engine(db, serialization_retries=100)
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO counters (name, n) VALUES (:s, 0)"), {"s": scope})
    op: rp.Operation[Any] = rp.Operation("contended_pipelines")

    @op.atomic_phase("counted")
    def counted(tx: rp.AtomicContext, params: Any) -> None:
        (n,) = tx.execute("SELECT n FROM counters WHERE name = %s", (scope,)).fetchone()
        tx.execute("UPDATE counters SET n = %s WHERE name = %s", (n + 1, scope))
        tx.stage_job("counted", {"n": n + 1})

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute("UPDATE counters SET n = n + 1000 WHERE name = %s", (scope,))
        return rp.Response(200)

    engine.register(op)
    rollbacks_before = rollbacks(db)
    caplog.set_level(logging.WARNING, logger="psycopg")
    try:
        with ThreadPoolExecutor(32) as pool:
            outcomes = list(
                pool.map(lambda i: engine.run(op, key=f"k{i}", params={}, scope=scope), range(32))
            )
        assert [o.status for o in outcomes] == [200] * 32
        assert count(db, "SELECT n FROM counters WHERE name = :s", s=scope) == 32 * 1001
        # The error paths did run (statistics reach pg_stat_database within a second or so,
        # later on a busy machine: a minute at most).
        deadline = time.monotonic() + 60
        while rollbacks(db) <= rollbacks_before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rollbacks(db) > rollbacks_before
        # psycopg reports a pipeline left open as "error ignored terminating <Pipeline>".
        assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []
        pool_status = db.pool.status()
        assert "Current Checked out connections: 0" in pool_status, pool_status
        with db.connect() as conn:
            idle_in_transaction = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        assert idle_in_transaction == 0
    finally:
        db.dispose()


def rollbacks(db: sa.Engine) -> int:
    with db.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sa.text(
                    "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()"
                )
            ).scalar_one()
        )


def test_a_connection_is_handed_back_to_the_pool_as_it_came(
    database_url: str, business_tables: None, scope: str
) -> None:
    """An application's own engine in autocommit stays in autocommit after a request, and
    one that is not stays not: the request path switches psycopg's mode for itself only."""
    for isolation in ("AUTOCOMMIT", "READ COMMITTED"):
        db = create_engine(database_url, pool_size=1, max_overflow=0, isolation_level=isolation)
        try:
            engine = rp.Engine(db)
            op: rp.Operation[Any] = rp.Operation(f"pool_mode_{isolation.split()[0].lower()}")

            @op.atomic_phase("finished")
            def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
                return rp.Response(200)

            engine.register(op)
            with db.connect() as conn:
                before = conn.connection.driver_connection.autocommit  # type: ignore[union-attr]
            engine.run(op, key="k", params={}, scope=scope)
            with db.connect() as conn:
                after = conn.connection.driver_connection.autocommit  # type: ignore[union-attr]
            assert after == before == (isolation == "AUTOCOMMIT")
        finally:
            db.dispose()
