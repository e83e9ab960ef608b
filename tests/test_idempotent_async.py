"""``@rp.idempotent`` on async functions through ``rp.AsyncEngine``, on a real database,
against the payment API of ``idempotent_payments`` over HTTP on loopback. Each test runs its
own event loop, with an engine made (and disposed of) inside it."""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
from idempotent_payments import Payments, payments_api
from pydantic import BaseModel

import recoverypoint as rp

T = TypeVar("T")


class Receipt(BaseModel):
    charge_id: str
    amount: int


@pytest.fixture(scope="module")
def payments() -> Iterator[tuple[Payments, str]]:
    with payments_api() as api:
        yield api


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def with_engine(database_url: str, test: Callable[[Any], Awaitable[T]]) -> T:
    async def main() -> T:
        engine = rp.AsyncEngine(database_url)
        try:
            return await test(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def charge_at(
    client: httpx.AsyncClient, url: str, amount: int, *, fail: bool = False, delay: float = 0
) -> str:
    query = {"fail": "1"} if fail else {}
    if delay:
        query["delay"] = str(delay)
    response = await client.post(
        f"{url}/charges",
        params=query,
        json={"amount": amount},
        headers={"Idempotency-Key": rp.downstream_key()},
        timeout=10,
    )
    response.raise_for_status()
    return str(response.json()["id"])


def key_row(db: sa.Engine, operation: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT recovery_point, attempts, locked_at, response_status "
                "FROM idempotency_keys WHERE operation = :o"
            ),
            {"o": operation},
        ).one()


def test_an_async_function_runs_once_and_replays_its_model(
    database_url: str, payments: tuple[Payments, str]
) -> None:
    api, url = payments

    async def test(engine: Any) -> None:
        async with httpx.AsyncClient() as client:

            @rp.idempotent(engine, key=lambda a: f"order:{a['order_id']}", name=unique("pay"))
            async def pay(order_id: int, amount: int) -> Receipt:
                return Receipt(charge_id=await charge_at(client, url, amount), amount=amount)

            first = await pay(17, 2500)
            assert await pay(order_id=17, amount=2500) == first
            assert isinstance(first, Receipt)
            [downstream] = [k for k, c in api.charges.items() if c["id"] == first.charge_id]
            assert api.calls[downstream] == 1
            with pytest.raises(rp.ParamsMismatch):
                await pay(17, 2600)

    with_engine(database_url, test)


def test_a_lost_key_row_hands_the_payment_api_the_same_downstream_key(
    database_url: str, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    # As with a failover to a lagging standby: the key row of a call that charged is lost;
    # the call made again must hand the API the same key, and get back the same charge.
    api, url = payments
    name = unique("pay")

    async def test(engine: Any) -> None:
        async with httpx.AsyncClient() as client:

            @rp.idempotent(engine, key="order_id", name=name)
            async def pay(order_id: int, amount: int) -> Receipt:
                return Receipt(charge_id=await charge_at(client, url, amount), amount=amount)

            first = await pay(17, 2500)
            with db.begin() as conn:
                conn.execute(
                    sa.text("DELETE FROM idempotency_keys WHERE operation = :o"), {"o": name}
                )
            assert await pay(17, 2500) == first
            [downstream] = [k for k, c in api.charges.items() if c["id"] == first.charge_id]
            assert api.calls[downstream] == 2  # the body ran again, with the same key

    with_engine(database_url, test)


def test_concurrent_tasks_on_one_key_run_the_body_once(
    database_url: str, payments: tuple[Payments, str]
) -> None:
    api, url = payments

    async def test(engine: Any) -> None:
        async with httpx.AsyncClient() as client:

            # The body charges once every other caller has been refused: on a busy machine
            # a delay alone may end before the last caller arrives, which gets a replay.
            refused: list[None] = []
            all_refused = asyncio.Event()

            @rp.idempotent(engine, key="order_id", name=unique("slow"))
            async def slow(order_id: str) -> str:
                await asyncio.wait_for(all_refused.wait(), 60)
                return await charge_at(client, url, 100)

            async def call() -> str:
                try:
                    return await slow("o-1")
                except rp.KeyInUse:
                    refused.append(None)
                    if len(refused) == 15:
                        all_refused.set()
                    return "in use"

            results = await asyncio.gather(*(call() for _ in range(16)))
            winners = [r for r in results if r != "in use"]
            assert len(winners) == 1 and results.count("in use") == 15
            assert await slow("o-1") == winners[0]
            [downstream] = [k for k, c in api.charges.items() if c["id"] == winners[0]]
            assert api.calls[downstream] == 1

    with_engine(database_url, test)


def test_a_failure_propagates_and_the_retry_runs_with_the_same_downstream_key(
    database_url: str, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    api, url = payments
    name = unique("flaky")

    async def test(engine: Any) -> list[str]:
        seen: list[str] = []
        fail = [True, False]
        async with httpx.AsyncClient() as client:

            @rp.idempotent(engine, key="order_id", name=name)
            async def flaky(order_id: str) -> str:
                seen.append(rp.downstream_key())
                return await charge_at(client, url, 300, fail=fail.pop(0))

            with pytest.raises(httpx.HTTPStatusError):
                await flaky("o-2")
            assert tuple(key_row(db, name)) == ("started", 1, None, None)
            charge_id = await flaky("o-2")
            assert await flaky("o-2") == charge_id
        return seen

    seen = with_engine(database_url, test)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert api.calls[seen[0]] == 2


def test_a_cancelled_call_releases_its_lease_and_the_next_call_runs(
    database_url: str, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    api, url = payments
    name = unique("cancelled")

    async def test(engine: Any) -> None:
        delays = [3.0, 0.0]
        downstream: list[str] = []
        async with httpx.AsyncClient() as client:

            @rp.idempotent(engine, key="order_id", name=name)
            async def charge(order_id: str) -> str:
                downstream.append(rp.downstream_key())
                return await charge_at(client, url, 100, delay=delays.pop(0))

            task = asyncio.create_task(charge("o-3"))
            # Cancelled while the provider holds the request (for 3 s), once it has it.
            for _ in range(6000):  # the bound only turns a hang into a failure
                if downstream and api.calls[downstream[0]]:
                    break
                await asyncio.sleep(0.01)
            assert not task.done() and api.calls[downstream[0]] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            recovery_point, attempts, locked_at, status = key_row(db, name)
            assert (recovery_point, locked_at, status) == ("started", None, None)
            assert attempts == 1
            started = time.monotonic()
            assert (await charge("o-3")).startswith("ch_")  # no KeyInUse: the lease is free
            assert time.monotonic() - started < 5

    with_engine(database_url, test)


@pytest.mark.slow
def test_context_variables_and_the_downstream_key_reach_the_functions_own_tasks(
    database_url: str,
) -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")

    async def test(engine: Any) -> None:
        @rp.idempotent(engine, key="k", name=unique("fan_out"))
        async def fan_out(k: str) -> list[str]:
            async def part() -> str:
                return f"{request_id.get()}:{rp.downstream_key('part')}"

            return list(await asyncio.gather(part(), part()))

        request_id.set("req-1")
        first, second = await fan_out("k")
        assert first == second and first.startswith("req-1:")

    with_engine(database_url, test)


@pytest.mark.slow
def test_calls_at_once_are_all_in_flight_together(
    database_url: str, payments: tuple[Payments, str]
) -> None:
    """50 calls made at once are all inside the function at the same time: each waits
    there until every other has come in, which never happens if the engine runs them one
    after another, or holds something (a connection, the event loop) while one runs.
    Events, not the clock: the bound only turns a hang into a failure."""
    provider, url = payments
    calls = 50
    charged_before = len(provider.charges)  # the provider serves the module's other tests too

    async def test(engine: Any) -> list[str]:
        entered = 0
        everyone_in = asyncio.Event()
        async with httpx.AsyncClient() as client:

            @rp.idempotent(engine, key="k", name=unique("at_once"))
            async def charge(k: str) -> str:
                nonlocal entered
                entered += 1
                if entered == calls:
                    everyone_in.set()
                await asyncio.wait_for(everyone_in.wait(), 600)
                return await charge_at(client, url, 1)

            return await asyncio.gather(*(charge(uuid.uuid4().hex) for _ in range(calls)))

    charges = with_engine(database_url, test)
    assert len(set(charges)) == calls
    assert len(provider.charges) - charged_before == calls


def test_a_sync_function_with_an_async_engine_is_a_type_error(database_url: str) -> None:
    async def test(engine: Any) -> None:
        def plain(k: str) -> None: ...

        with pytest.raises(TypeError, match=r"a sync function, which needs rp\.Engine"):
            rp.idempotent(engine, key="k")(plain)

    with_engine(database_url, test)


@pytest.mark.slow
def test_arguments_that_cannot_be_stored_store_nothing(database_url: str, db: sa.Engine) -> None:
    name = unique("refused")

    async def test(engine: Any) -> None:
        ran: list[Any] = []

        @rp.idempotent(engine, key="k", name=name)
        async def refused(k: str, value: Any) -> None:
            ran.append(value)

        for value in ("\x00", "\ud800", float("nan"), object(), _deep(200)):
            with pytest.raises(rp.InvalidParams):
                await refused(uuid.uuid4().hex, value)
        assert ran == []

    with_engine(database_url, test)
    with db.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT count(*) FROM idempotency_keys WHERE operation = :o"), {"o": name}
        ).scalar_one()
    assert stored == 0


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"a": value}
    return value
