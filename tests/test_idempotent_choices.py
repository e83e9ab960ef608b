"""``@rp.idempotent``'s choices on a real database: an optional key, a hook that tells a
replay, and a scope rule that may not yield an empty scope. Every run of a function is a
row of ``idem_choice_runs``, counted where it lands."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rides import count

import recoverypoint as rp

SCHEMA = """
CREATE TABLE IF NOT EXISTS idem_choice_runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    item text NOT NULL
)
"""


@pytest.fixture(scope="module", autouse=True)
def table(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def work(db: sa.Engine, item: str) -> int:
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO idem_choice_runs (item) VALUES (:i)"), {"i": item})
    return runs(db, item)


def runs(db: sa.Engine, item: str) -> int:
    return count(db, "SELECT count(*) FROM idem_choice_runs WHERE item = :i", i=item)


def keys_of(db: sa.Engine, operation: str) -> int:
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE operation = :o", o=operation)


def test_an_optional_key_left_out_runs_the_function_unprotected_and_logs_it(
    engine: rp.Engine, db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique("optional")

    @rp.idempotent(engine, key="key", name=name, key_required=False)
    def place(item: str, key: str | None = None) -> int:
        return work(db, item)

    item = unique("item")
    with caplog.at_level(logging.INFO, logger="recoverypoint"):
        assert place(item) == 1
        assert place(item) == 2  # unprotected: the duplicate runs
    assert keys_of(db, name) == 0
    assert [getattr(r, "idempotency", None) for r in caplog.records].count("unprotected") == 2
    # With a key, as protected as ever.
    assert place(item, key="k-1") == 3
    assert place(item, key="k-1") == 3
    assert runs(db, item) == 3 and keys_of(db, name) == 1


def test_a_key_left_out_is_refused_by_default_and_nothing_runs(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name = unique("required")

    @rp.idempotent(engine, key="key", name=name)
    def place(item: str, key: str | None = None) -> int:
        return work(db, item)

    item = unique("item")
    with pytest.raises(rp.InvalidKey):
        place(item)
    assert runs(db, item) == 0 and keys_of(db, name) == 0


def test_an_optional_key_left_out_of_an_async_function_runs_it_unprotected(
    database_url: str, db: sa.Engine
) -> None:
    item = unique("item")

    async def main() -> list[int]:
        engine = rp.AsyncEngine(database_url)
        try:

            @rp.idempotent(engine, key="key", name=unique("optional_async"), key_required=False)
            async def place(item: str, key: str | None = None) -> int:
                return await asyncio.to_thread(work, db, item)

            return [await place(item, key) for key in (None, None, "k", "k")]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [1, 2, 3, 3]


def test_on_replay_sees_the_outcome_of_every_replay_and_the_value_is_unchanged(
    engine: rp.Engine, db: sa.Engine
) -> None:
    seen: list[rp.Outcome] = []

    @rp.idempotent(engine, key="key", name=unique("hooked"), on_replay=seen.append)
    def place(item: str, key: str) -> dict[str, int]:
        return {"runs": work(db, item)}

    item = unique("item")
    first = place(item, "k-1")
    assert seen == []  # the call that ran is no replay
    again = place(item, "k-1")
    other = place(item, "k-2")

    assert first == again == {"runs": 1} and other == {"runs": 2}
    assert len(seen) == 1
    assert seen[0].replayed and seen[0].status == 200
    assert runs(db, item) == 2


def test_on_replay_on_an_async_function(database_url: str, db: sa.Engine) -> None:
    seen: list[rp.Outcome] = []
    item = unique("item")

    async def main() -> list[int]:
        engine = rp.AsyncEngine(database_url)
        try:

            @rp.idempotent(engine, key="key", name=unique("hooked_async"), on_replay=seen.append)
            async def place(item: str, key: str) -> int:
                return await asyncio.to_thread(work, db, item)

            return [await place(item, "k"), await place(item, "k")]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [1, 1]
    assert [outcome.replayed for outcome in seen] == [True]


def test_a_scope_rule_that_yields_an_empty_scope_is_refused_and_nothing_runs(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name = unique("scoped")

    @rp.idempotent(engine, key="key", scope="tenant", name=name)
    def place(item: str, key: str, tenant: str) -> int:
        return work(db, item)

    item = unique("item")
    with pytest.raises(ValueError, match=r"empty scope.*UNSCOPED"):
        place(item, "k-1", "")
    assert runs(db, item) == 0 and keys_of(db, name) == 0
    assert place(item, "k-1", "acme") == 1


_HOSTILE_SCOPES = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.text(min_size=256, max_size=300),
    st.sampled_from(["\x00", "a\x00b", "\ud800"]),
    st.integers(),
    st.none(),
    st.floats(),
)


@pytest.mark.slow
def test_any_scope_a_rule_yields_is_used_or_refused_before_the_function_runs(
    engine: rp.Engine, db: sa.Engine
) -> None:
    sent: dict[str, Any] = {}

    @rp.idempotent(engine, key=lambda a: sent["item"], scope=lambda a: sent["tenant"])
    def place() -> int:
        return work(db, sent["item"])

    @settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
    @given(tenant=_HOSTILE_SCOPES)
    def check(tenant: Any) -> None:
        sent.update(item=unique("item"), tenant=tenant)
        try:
            assert place() == 1
        except (ValueError, rp.InvalidParams):
            assert runs(db, sent["item"]) == 0
            return
        assert tenant != "" and runs(db, sent["item"]) == 1

    check()


def test_a_call_with_wait_gets_the_running_calls_value(engine: rp.Engine, db: sa.Engine) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    entered, released = threading.Event(), threading.Event()

    @rp.idempotent(engine, key="key", name=unique("waited"), wait=30)
    def place(item: str, key: str) -> int:
        if not entered.is_set():
            entered.set()
            assert released.wait(60)
        return work(db, item)

    item = unique("item")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(place, item, "k")
        assert entered.wait(60)
        waiting = pool.submit(place, item, "k")
        for _ in range(600):
            if count(
                db,
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
                "AND query LIKE '%%pg_advisory_lock_shared%%' AND datname = current_database()",
            ):
                break
            threading.Event().wait(0.05)
        released.set()
        assert first.result(60) == waiting.result(60) == 1
    assert runs(db, item) == 1


@pytest.mark.parametrize("wait", [-0.5, float("nan"), float("inf"), 10**9, True, "1"])
def test_a_bad_wait_is_refused_when_decorating(engine: rp.Engine, wait: Any) -> None:
    with pytest.raises(ValueError, match="wait"):

        @rp.idempotent(engine, key="key", name=unique("bad_wait"), wait=wait)
        def place(key: str) -> int:
            return 1
