"""A key's fate after its retention is decided when the engine reads it, not by when the
reaper last ran: within its operation's retention (72 hours by default) a reuse replays;
past it, a reuse is a new request, the old record replaced in the claim's transaction. An
abandoned key keeps replaying its error until the reaper's longer retention. The clock is
moved by moving ``finished_at`` back; no reaper runs in these tests."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from rides import count

import recoverypoint as rp

SCHEMA = """
CREATE TABLE IF NOT EXISTS retention_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item text NOT NULL
)
"""


@pytest.fixture(scope="module", autouse=True)
def table(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)


def declared(retention: timedelta | None) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(f"kept_{uuid.uuid4().hex[:8]}", retention=retention)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.connection.execute(
            sa.text("INSERT INTO retention_runs (item) VALUES (:i)"), {"i": params["item"]}
        )
        runs = tx.connection.scalar(
            sa.text("SELECT count(*) FROM retention_runs WHERE item = :i"), {"i": params["item"]}
        )
        return rp.Response(201, {"runs": runs})

    return op


def age(db: sa.Engine, op: rp.Operation[Any], by: str, *, abandoned: bool = False) -> None:
    """Make the operation's finished keys older by ``by`` (an SQL interval)."""
    extra = ", abandoned_at = finished_at" if abandoned else ""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE idempotency_keys SET finished_at = finished_at - CAST(:by AS interval)"
                f"{extra} WHERE operation = :o"
            ),
            {"by": by, "o": op.name},
        )


def keys_of(db: sa.Engine, op: rp.Operation[Any]) -> int:
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE operation = :o", o=op.name)


@pytest.mark.parametrize(
    ("retention", "within", "past"),
    [(None, "71 hours", "73 hours"), (timedelta(hours=1), "59 minutes", "61 minutes")],
)
def test_a_key_replays_within_its_retention_and_is_a_new_request_past_it(
    engine: rp.Engine, db: sa.Engine, retention: timedelta | None, within: str, past: str
) -> None:
    op = declared(retention)
    engine.register(op)
    item = uuid.uuid4().hex

    def call() -> rp.Outcome:
        return engine.run(op, key="k-1", params={"item": item})

    assert call().body == {"runs": 1}
    age(db, op, within)
    replayed = call()
    assert replayed.replayed and replayed.body == {"runs": 1}
    age(db, op, "2 minutes")  # now past it; the reaper never ran
    if past == "73 hours":
        age(db, op, "1 hour 58 minutes")
    anew = call()
    assert not anew.replayed and anew.body == {"runs": 2}
    assert call().replayed  # the new record is honoured in its turn
    assert count(db, "SELECT count(*) FROM retention_runs WHERE item = :i", i=item) == 2
    assert keys_of(db, op) == 1


@pytest.mark.slow
def test_past_its_retention_a_key_may_come_with_other_params(
    engine: rp.Engine, db: sa.Engine
) -> None:
    op = declared(timedelta(hours=1))
    engine.register(op)
    engine.run(op, key="k", params={"item": "a"})
    with pytest.raises(rp.ParamsMismatch):
        engine.run(op, key="k", params={"item": "b"})
    age(db, op, "2 hours")
    assert engine.run(op, key="k", params={"item": "b"}).status == 201


def test_an_abandoned_key_keeps_replaying_its_error_past_the_retention(
    engine: rp.Engine, db: sa.Engine
) -> None:
    op = declared(timedelta(hours=1))
    engine.register(op)
    item = uuid.uuid4().hex
    engine.run(op, key="k", params={"item": item})
    age(db, op, "2 hours", abandoned=True)
    assert engine.run(op, key="k", params={"item": item}).replayed
    assert count(db, "SELECT count(*) FROM retention_runs WHERE item = :i", i=item) == 1


def test_the_async_engine_reads_the_same_rule(database_url: str, db: sa.Engine) -> None:
    op: rp.Operation[Any] = rp.Operation(
        f"kept_{uuid.uuid4().hex[:8]}", retention=timedelta(hours=1)
    )
    item = uuid.uuid4().hex

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        await tx.execute("INSERT INTO retention_runs (item) VALUES (%(i)s)", {"i": item})
        runs = await tx.scalar(
            "SELECT count(*) FROM retention_runs WHERE item = %(i)s", {"i": item}
        )
        return rp.Response(201, {"runs": runs})

    async def call() -> rp.Outcome:
        engine = rp.AsyncEngine(database_url)
        engine.register(op)
        try:
            return await engine.run(op, key="k", params={"item": item})
        finally:
            await engine.dispose()

    asyncio.run(call())
    age(db, op, "2 hours")
    again = asyncio.run(call())
    assert not again.replayed and again.body == {"runs": 2}


def test_duplicates_racing_past_the_retention_make_one_new_request(
    engine: rp.Engine, db: sa.Engine
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    op = declared(timedelta(hours=1))
    engine.register(op)
    item = uuid.uuid4().hex
    engine.run(op, key="k", params={"item": item})
    age(db, op, "2 hours")

    def call() -> str:
        try:
            return "replayed" if engine.run(op, key="k", params={"item": item}).replayed else "ran"
        except (rp.KeyInUse, rp.ConcurrentUpdate):
            return "refused"

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: call(), range(8)))
    assert results.count("ran") == 1
    assert count(db, "SELECT count(*) FROM retention_runs WHERE item = :i", i=item) == 2
    assert keys_of(db, op) == 1


@settings(max_examples=40)
@given(seconds=st.integers(min_value=1, max_value=10**6), aged=st.integers(0, 2 * 10**6))
@pytest.mark.slow
def test_the_rule_at_any_retention_and_age(db: sa.Engine, seconds: int, aged: int) -> None:
    engine = rp.Engine(db)
    op = declared(timedelta(seconds=seconds))
    engine.register(op)
    item = uuid.uuid4().hex
    engine.run(op, key="k", params={"item": item})
    age(db, op, f"{aged} seconds")
    again = engine.run(op, key="k", params={"item": item})
    # Strictly within: replayed. Well past (the test's own seconds cannot blur it): anew.
    if aged + 60 < seconds:
        assert again.replayed
    elif aged > seconds:
        assert not again.replayed
