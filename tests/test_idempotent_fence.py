"""``@rp.idempotent``'s answer is recorded without a fence of its own: it sends no statement,
so the write that records it finds the key row by address and lease, locks it, and misses
it where the fence would have (see recoverypoint.engine.store.fence_later). What another
writer does to the row while the answer is built decides the outcome, on both engines: a
takeover or a lost row fails with LockLost and finishes nothing; a row that only moved (a
new row version, the lease kept) is found again and finished once. Where Citus distributes
the keys the answer keeps its fence, which binds its transaction to the scope's worker:
the row is locked before the answer is built."""

from __future__ import annotations

import asyncio
import importlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import recoverypoint as rp

# The package, not the decorator that recoverypoint.idempotent names once imported.
idempotent_module = importlib.import_module("recoverypoint.idempotent")

TAKEOVER = "UPDATE idempotency_keys SET lock_token = gen_random_uuid()"
# What another writer does to the key row between the body's return and the answer's
# write, and whether the call must still finish.
WRITES = {
    "a takeover": (TAKEOVER, False),
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
    """Make ``write`` to the key row of operation ``name`` as its answer is built (the
    first time only); what the row was then, one entry per answer built: its point, or
    ``locked`` when another transaction held it."""
    seen: list[str] = []
    finish = idempotent_module._finish

    def meddling(tx: Any, params: Any) -> rp.Response:
        if not seen:
            try:
                with db.begin() as conn:
                    conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                    seen.append(
                        conn.execute(
                            sa.text(f"{write} WHERE operation = :o RETURNING recovery_point"),
                            {"o": name},
                        ).scalar_one()
                    )
            except sa.exc.OperationalError as exc:
                assert isinstance(exc.orig, psycopg.errors.LockNotAvailable)
                seen.append("locked")
        else:
            seen.append("again")
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


def sync_call(engine: rp.Engine, name: str, calls: list[str]) -> Callable[[], Any]:
    @rp.idempotent(engine, key="order_id", name=name)
    def place(order_id: str, total: int) -> dict[str, Any]:
        calls.append(order_id)
        return {"order": order_id, "total": total}

    return lambda: place("o-1", 2000)


@pytest.mark.parametrize("meddler", list(WRITES))
def test_the_sync_answer_is_fenced_by_the_write_that_records_it(
    engine: rp.Engine, db: sa.Engine, monkeypatch: pytest.MonkeyPatch, meddler: str
) -> None:
    write, finishes = WRITES[meddler]
    name = unique("answer_fence")
    seen = while_answering(monkeypatch, db, name, write)
    calls: list[str] = []
    expect(db, name, finishes, sync_call(engine, name, calls), calls)
    assert seen == ["started"]  # the row was not locked while the answer was built


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


def test_a_takeover_that_commits_while_the_answer_waits_for_the_row(
    engine: rp.Engine, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The new owner's write holds the row as the answer's write reaches it, and commits
    # once that write waits: under SERIALIZABLE the write fails (40001), the answer runs
    # again, and its write then misses the row whose lease is gone: LockLost.
    name = unique("answer_waits")
    finish = idempotent_module._finish
    built: list[str] = []
    taken, committed = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    waiting = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database() AND query LIKE '%idempotency_keys%'"
    )

    def takeover() -> None:
        try:
            with db.begin() as conn:
                conn.execute(sa.text(f"{TAKEOVER} WHERE operation = :o"), {"o": name})
                taken.set()
                with db.connect() as watcher:
                    for _ in range(6000):  # until the answer's write waits for this row
                        if watcher.execute(waiting).scalar_one():
                            break
                        watcher.rollback()
                        committed.wait(0.01)
                    else:
                        raise AssertionError("the answer's write never waited for the row")
        except BaseException as exc:
            failures.append(exc)
        finally:
            taken.set()
            committed.set()

    def answer(tx: Any, params: Any) -> rp.Response:
        built.append("answer")
        if len(built) == 1:
            threading.Thread(target=takeover).start()
            assert taken.wait(60)  # the row is held before this answer's write is sent
        return finish(tx, params)

    monkeypatch.setattr(idempotent_module, "_finish", answer)
    calls: list[str] = []
    with pytest.raises(rp.LockLost):
        sync_call(engine, name, calls)()
    assert committed.wait(60) and not failures
    assert built == ["answer", "answer"]  # the write failed once, and the answer ran again
    assert calls == ["o-1"]
    row = key_row(db, name)
    assert (row.recovery_point, row.response_status) == ("started", None)


def test_as_on_citus_the_answer_keeps_its_fence(
    db: sa.Engine, business_tables: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = rp.Engine(db)
    engine._bound = True  # as engine_both_ways's "as on Citus": the fence binds the worker
    name = unique("answer_bound")
    seen = while_answering(monkeypatch, db, name, TAKEOVER)
    calls: list[str] = []
    expect(db, name, True, sync_call(engine, name, calls), calls)
    assert seen == ["locked"]  # the fence held the row while the answer was built


def test_a_phase_that_leaves_its_fence_to_its_write_may_send_nothing(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    # Its statement would have run unfenced, and the write's retry at a moved row would
    # have rolled it back and committed the point without it: refused, nothing recorded.
    op: rp.Operation[Any] = rp.Operation(unique("sends_something"))

    @op.foreign_step("called")  # as @idempotent's: a fresh key's first phase is the claim's
    def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {}

    @op._declare("finished", "atomic", (), sends_nothing=True)
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'unfenced', %s)",
            (scope, tx.key_id),
        )
        return rp.Response(200, {})

    engine.register(op)
    with pytest.raises(AssertionError, match="sent a statement"):
        engine.run(op, key="k", params={}, scope=scope)
    with db.connect() as conn:
        audits = conn.execute(
            sa.text("SELECT count(*) FROM audit_records WHERE scope = :s AND action = 'unfenced'"),
            {"s": scope},
        ).scalar_one()
        status = conn.execute(
            sa.text("SELECT response_status FROM idempotency_keys WHERE operation = :o"),
            {"o": op.name},
        ).scalar_one()
    assert (audits, status) == (0, None)
