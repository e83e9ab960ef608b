"""Hostile input on rp.AsyncEngine, from the strategies of test_hostile.py: bad params, keys,
methods and paths get a 4xx and store nothing; good ones run once and replay the same."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_hostile import (
    DEEP,
    HOSTILE,
    Deep,
    Huge,
    any_char,
    built,
    keys_in,
    printable,
    python_params,
    rendered,
)

import recoverypoint as rp

RUNS: Counter[str] = Counter()


def echo() -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(f"async_echo_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    async def answer(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        scope = await tx.scalar("SELECT scope FROM idempotency_keys WHERE id = %s", (tx.key_id,))
        RUNS[scope] += 1
        return rp.Response(201, {"params": params})

    return op


class Loop:
    """One event loop for a whole module's examples, with an engine on it."""

    def __init__(self, database_url: str) -> None:
        # What asyncio.Runner (Python 3.11) does: one loop, each call run to its end on it.
        self.loop = asyncio.new_event_loop()
        self.engine = rp.AsyncEngine(database_url)
        self.op = echo()
        self.engine.register(self.op)

    def run(
        self, *, key: Any, scope: str, params: Any, request: rp.Request
    ) -> rp.Outcome | rp.IdempotencyError:
        try:
            return self.loop.run_until_complete(
                self.engine.run(self.op, key=key, scope=scope, params=params, request=request)
            )
        except rp.IdempotencyError as exc:
            assert exc.http_status < 500, f"{type(exc).__name__} ({exc.http_status})"
            return exc

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.dispose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="module")
def loop(database_url: str) -> Iterator[Loop]:
    made = Loop(database_url)
    yield made
    made.close()


def twice(loop: Loop, db: sa.Engine, *, key: Any, params: Any, request: rp.Request) -> None:
    scope = uuid.uuid4().hex
    first = loop.run(key=key, scope=scope, params=params, request=request)
    again = loop.run(key=key, scope=scope, params=params, request=request)
    if isinstance(first, rp.IdempotencyError):
        assert keys_in(db, scope) == 0 and RUNS[scope] == 0
        assert type(again) is type(first)
        return
    assert isinstance(again, rp.Outcome) and again.replayed and not first.replayed
    assert rendered(again) == rendered(first)
    assert keys_in(db, scope) == 1 and RUNS[scope] == 1


@pytest.mark.slow
@settings(HOSTILE, max_examples=60)
@given(params=python_params)
@example(params={"name": "\ud800"})
@example(params={"name": "\x00"})
@example(params={"x": float("nan")})
@example(params={"x": 1e16})
@example(params={"x": 10**5000})
@example(params={1: "a", "1": "b"})
@example(params=Deep(DEEP))
@example(params=Huge(70_000))
def test_bad_params_get_a_4xx_and_good_ones_replay(loop: Loop, db: sa.Engine, params: Any) -> None:
    twice(loop, db, key="k", params=built(params), request=rp.Request("POST", "/orders"))


@settings(HOSTILE, max_examples=40)
@given(key=st.one_of(st.text(any_char, max_size=300), st.text(printable, max_size=300)))
@example(key="")
@example(key="k" * 256)
@example(key="\ud800")
@example(key="k\x00")
@pytest.mark.slow
def test_bad_keys_get_a_400(loop: Loop, db: sa.Engine, key: str) -> None:
    twice(loop, db, key=key, params={"n": 1}, request=rp.Request("POST", "/orders"))


@settings(HOSTILE, max_examples=40)
@given(method=st.text(any_char, max_size=6), path=st.text(any_char, max_size=30))
@example(method="POST", path="/orders/\x00")
@example(method="\udfff", path="/orders")
@example(method="POST", path="/" + "x" * 100_000)
@pytest.mark.slow
def test_bad_methods_and_paths_get_a_4xx(loop: Loop, db: sa.Engine, method: str, path: str) -> None:
    twice(loop, db, key="k", params={"n": 1}, request=rp.Request(method, path))
