"""``@rp.idempotent``'s answer is recorded without a fence of its own: it sends no statement,
so the write that records it finds the key row by address and lease, locks it, and misses
it where the fence would have (see recoverypoint.engine.store.fence_later). What another
writer does to the row while the answer is built decides the outcome, on both engines: a
takeover or a lost row fails with LockLost and finishes nothing; a row that only moved (a
new row version, the lease kept) is found again and finished once."""

from __future__ import annotations

import asyncio
import importlib
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import recoverypoint as rp

# The package, not the decorator that recoverypoint.idempotent names once imported.
idempotent_module = importlib.import_module("recoverypoint.idempotent")

# What another writer does to the key row between the body's committed result and the
# answer's write, and whether the call must still finish.
WRITES = {
    "a takeover": ("UPDATE idempotency_keys SET lock_token = gen_random_uuid()", False),
    "the lease given up": (
        "UPDATE idempotency_keys SET lock_token = NULL, locked_at = NULL",
        False,
    ),
    "the row lost (a failover to a lagging standby)": ("DELETE FROM idempotency_keys", False),
    "a new row version, the lease kept": (
        "UPDATE idempotency_keys SET last_run_at = last_run_at",
        True,
    ),
}


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def key_row(db: sa.Engine, name: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT recovery_point, response_status, response_body, lock_token "
                "FROM idempotency_keys WHERE operation = :o"
            ),
            {"o": name},
        ).one_or_none()


def while_answering(
    monkeypatch: pytest.MonkeyPatch, db: sa.Engine, name: str, write: str
) -> list[str]:
    """Make ``write`` to the key row of operation ``name`` as its answer is built; the
    points the row was at then, one per answer built."""
    seen: list[str] = []
    finish = idempotent_module._finish

    def meddling(tx: Any, params: Any) -> rp.Response:
        with db.begin() as conn:
            point = conn.execute(
                sa.text(f"{write} WHERE operation = :o RETURNING recovery_point"), {"o": name}
            ).scalar_one()
        seen.append(point)
        return finish(tx, params)

    async def meddling_async(tx: Any, params: Any) -> rp.Response:
        return meddling(tx, params)

    monkeypatch.setattr(idempotent_module, "_finish", meddling)
    monkeypatch.setattr(idempotent_module, "_finish_async", meddling_async)
    return seen


def expect(
    db: sa.Engine, name: str, finishes: bool, call: Callable[[], Any], calls: list[str]
) -> None:
    if not finishes:
        with pytest.raises(rp.LockLost):
            call()
        row = key_row(db, name)
        assert row is None or (row.recovery_point, row.response_status) == ("started", None)
        assert calls == ["o-1"]  # the body ran once, and its answer was never recorded
        return
    first = call()
    again = call()  # a replay: the body does not run again
    assert first == again == {"order": "o-1", "total": 2000}
    row = key_row(db, name)
    assert (row.recovery_point, row.response_status, row.lock_token) == ("finished", 200, None)
    assert row.response_body == first
    assert calls == ["o-1"]


@pytest.mark.parametrize("meddler", list(WRITES))
def test_the_sync_answer_is_fenced_by_the_write_that_records_it(
    engine: rp.Engine, db: sa.Engine, monkeypatch: pytest.MonkeyPatch, meddler: str
) -> None:
    write, finishes = WRITES[meddler]
    name = unique("answer_fence")
    seen = while_answering(monkeypatch, db, name, write)
    calls: list[str] = []

    @rp.idempotent(engine, key="order_id", name=name)
    def place(order_id: str, total: int) -> dict[str, Any]:
        calls.append(order_id)
        return {"order": order_id, "total": total}

    expect(db, name, finishes, lambda: place("o-1", 2000), calls)
    assert seen == ["started"]  # the write came after the body had run


@pytest.mark.parametrize("meddler", list(WRITES))
def test_the_async_answer_is_fenced_by_the_write_that_records_it(
    database_url: str,
    business_tables: None,
    db: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    meddler: str,
) -> None:
    write, finishes = WRITES[meddler]
    name = unique("answer_fence_async")
    seen = while_answering(monkeypatch, db, name, write)
    calls: list[str] = []

    async def main() -> None:
        engine = rp.AsyncEngine(database_url)
        try:

            @rp.idempotent(engine, key="order_id", name=name)
            async def place(order_id: str, total: int) -> dict[str, Any]:
                calls.append(order_id)
                return {"order": order_id, "total": total}

            loop = asyncio.get_running_loop()

            def call() -> Any:  # the sync checks of expect(), each call on this loop
                return asyncio.run_coroutine_threadsafe(place("o-1", 2000), loop).result()

            await asyncio.to_thread(expect, db, name, finishes, call, calls)
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert seen == ["started"]
