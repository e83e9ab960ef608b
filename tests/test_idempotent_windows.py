"""@idempotent with its provider's dedupe window: past it, the function is never called
blindly again for a key. A ``reconcile`` hook, called as the function is, asks the provider
what the first call did; without one the call raises NeedsReconciliation. Time is moved
with testing.Clock, on a database of each test's own."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.testing import Clock

WINDOW = timedelta(hours=24)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # psycopg's async connections run on asyncio


class Provider:
    """A payment provider that charges once per idempotency key and can lose its answer."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.charges: dict[str, str] = {}
        self.lose_answers = 0

    def charge(self, key: str) -> str:
        self.calls.append(key)
        charge = self.charges.setdefault(key, f"ch_{len(self.charges) + 1}")
        if self.lose_answers:
            self.lose_answers -= 1
            raise ConnectionError("the provider's answer was lost")
        return charge

    def find(self, key: str) -> str | None:
        return self.charges.get(key)


def declared(engine: rp.Engine, provider: Provider, **options: Any) -> Any:
    @rp.idempotent(engine, key="key", name="pay", dedupe_window=WINDOW, **options)
    def pay(amount: int, *, key: str) -> str:
        return provider.charge(rp.downstream_key())

    return pay


def first_call_lost(pay: Any, provider: Provider) -> None:
    """The first call charges, and its answer is lost: the key stays unfinished."""
    provider.lose_answers = 1
    with pytest.raises(ConnectionError):
        pay(1000, key="k")
    assert len(provider.charges) == 1


def test_inside_the_window_the_call_runs_again_with_the_same_key(worker_db: sa.Engine) -> None:
    provider = Provider()
    pay = declared(rp.Engine(worker_db), provider)
    first_call_lost(pay, provider)
    Clock(worker_db).advance(WINDOW - timedelta(hours=1))
    assert pay(1000, key="k") == "ch_1"
    assert provider.calls == [provider.calls[0]] * 2 and len(provider.charges) == 1


def test_past_the_window_without_a_hook_nothing_is_called(worker_db: sa.Engine) -> None:
    provider = Provider()
    pay = declared(rp.Engine(worker_db), provider)
    first_call_lost(pay, provider)
    Clock(worker_db).advance(WINDOW)
    for _ in range(2):
        with pytest.raises(rp.NeedsReconciliation):
            pay(1000, key="k")
    assert len(provider.calls) == 1


def test_past_the_window_the_hook_finds_the_first_charge(worker_db: sa.Engine) -> None:
    provider = Provider()
    asked: list[str] = []

    def reconcile(amount: int, *, key: str) -> object:
        asked.append(rp.downstream_key())
        return provider.find(rp.downstream_key()) or rp.NotFound

    pay = declared(rp.Engine(worker_db), provider, reconcile=reconcile)
    first_call_lost(pay, provider)
    Clock(worker_db).advance(WINDOW)
    assert pay(1000, key="k") == "ch_1"
    assert pay(1000, key="k") == "ch_1"  # stored: a replay
    assert asked == provider.calls and len(provider.calls) == 1


def test_past_the_window_a_forgotten_call_is_made_anew_with_a_fresh_key(
    worker_db: sa.Engine,
) -> None:
    provider = Provider()
    pay = declared(rp.Engine(worker_db), provider, reconcile=lambda amount, *, key: rp.NotFound)
    first_call_lost(pay, provider)
    provider.charges.clear()  # the provider forgot the first call
    Clock(worker_db).advance(WINDOW)
    assert pay(1000, key="k") == "ch_1"
    assert len(provider.calls) == 2 and provider.calls[0] != provider.calls[1]


@pytest.mark.anyio
async def test_an_async_function_and_its_hook(worker_database_url: str) -> None:
    provider = Provider()
    async_db = create_async_engine(normalize_url(worker_database_url), poolclass=NullPool)
    engine = rp.AsyncEngine(async_db)

    async def reconcile(amount: int, *, key: str) -> object:
        return provider.find(rp.downstream_key()) or rp.NotFound

    @rp.idempotent(engine, key="key", name="apay", dedupe_window=WINDOW, reconcile=reconcile)
    async def pay(amount: int, *, key: str) -> str:
        return provider.charge(rp.downstream_key())

    provider.lose_answers = 1
    with pytest.raises(ConnectionError):
        await pay(1000, key="k")
    Clock(engine).advance(WINDOW)
    assert await pay(1000, key="k") == "ch_1"
    assert len(provider.calls) == 1
    await engine.async_db.dispose()
    engine.db.dispose()


def test_a_hook_of_the_wrong_kind_or_without_a_window_is_refused(worker_db: sa.Engine) -> None:
    engine = rp.Engine(worker_db)

    async def hook(amount: int, *, key: str) -> object:
        return rp.NotFound

    with pytest.raises(TypeError, match="reconcile hook"):

        @rp.idempotent(engine, key="key", name="p1", dedupe_window=WINDOW, reconcile=hook)
        def pay(amount: int, *, key: str) -> str:
            return ""

    with pytest.raises(rp.DeclarationError, match="dedupe_window"):

        @rp.idempotent(engine, key="key", name="p2", reconcile=lambda amount, *, key: "")
        def pay2(amount: int, *, key: str) -> str:
            return ""
