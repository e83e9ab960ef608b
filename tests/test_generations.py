"""A key reused after its retention is a new request, at its providers too; a key row lost
in a failover is not (recoverypoint.generations).

Stripe: "we generate a new request if a key is reused after the original is pruned"; the
IETF draft: an expired key starts a new request. Both against a provider that follows
Stripe's rule (a known key with other params is refused), the old row reaped or only past
its retention, on both engines and ``@idempotent``: the reuse must hand the provider new
downstream keys (and its jobs new job keys), the same ones at every retry and after a
failover that loses its row. "72 hours later" is the key's rows moved back in time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.testing import Clock
from recoverypoint.workers import Reaper

SCHEMA = """
CREATE TABLE IF NOT EXISTS strict_charges (
    downstream_key text PRIMARY KEY,
    amount integer NOT NULL,
    id text NOT NULL DEFAULT 'ch_' || md5(random()::text)
)
"""


class Refused(Exception):
    """The provider's answer to a known key with other params (Stripe's 400)."""


class StrictProvider:
    """A payment provider that follows Stripe's rule, on a table of its own: a known key with
    the same params returns the first charge, with other params it is refused."""

    def __init__(self, db: sa.Engine) -> None:
        self.db = db.execution_options(isolation_level="AUTOCOMMIT")
        self.keys_seen: list[str] = []
        self.fail_after_charge = 0
        """How many of the next calls fail after charging, as a lost answer would."""

    def charge(self, downstream_key: str, amount: int) -> str:
        self.keys_seen.append(downstream_key)
        with self.db.connect() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO strict_charges (downstream_key, amount) VALUES (:k, :a) "
                    "ON CONFLICT (downstream_key) DO NOTHING"
                ),
                {"k": downstream_key, "a": amount},
            )
            charge = conn.execute(
                sa.text("SELECT id, amount FROM strict_charges WHERE downstream_key = :k"),
                {"k": downstream_key},
            ).one()
        if charge.amount != amount:
            raise Refused(
                "Keys for idempotent requests can only be used with the same parameters "
                "they were first used with"
            )
        if self.fail_after_charge:
            self.fail_after_charge -= 1
            raise rp.Retryable("the answer was lost")
        return str(charge.id)

    def charges(self) -> dict[str, int]:
        """The charges made under the keys this test handed out: key -> amount."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT downstream_key, amount FROM strict_charges "
                    "WHERE downstream_key = ANY(:keys)"
                ),
                {"keys": list(set(self.keys_seen))},
            )
            return {row.downstream_key: row.amount for row in rows}


@pytest.fixture
def provider(db: sa.Engine) -> StrictProvider:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    return StrictProvider(db)


Call = Callable[[int], dict[str, Any]]
"""One request with the test's key and ``amount``: the body of its 2xx answer."""


def sync_operation(name: str, provider: StrictProvider) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"charge": provider.charge(step.downstream_key(), params["amount"])}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        job = tx.stage_job("send_receipt", {"charge": tx.state["charge"]})
        return rp.Response(201, {"charge": tx.state["charge"], "job": job})

    return op


def async_operation(name: str, provider: StrictProvider) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.foreign_step("charged")
    async def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"charge": provider.charge(step.downstream_key(), params["amount"])}

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: dict[str, Any]) -> rp.Response:
        job = tx.stage_job("send_receipt", {"charge": tx.state["charge"]})
        return rp.Response(201, {"charge": tx.state["charge"], "job": job})

    return op


@pytest.fixture(params=["sync", "async", "idempotent"])
def flavour(
    request: pytest.FixtureRequest,
    engine: rp.Engine,
    database_url: str,
    provider: StrictProvider,
    scope: str,
) -> Iterator[tuple[str, Call]]:
    """The operation's name and how to call it, on the engine under test."""
    name = f"gen_{uuid.uuid4().hex[:10]}"
    if request.param == "sync":
        op = sync_operation(name, provider)
        engine.register(op)

        def run(amount: int) -> dict[str, Any]:
            outcome = engine.run(op, key="k", scope=scope, params={"amount": amount})
            assert outcome.status == 201
            return dict(outcome.body)

        yield name, run
    elif request.param == "async":
        op = async_operation(name, provider)
        with asyncio.Runner() as runner:
            async_engine = runner.run(_async_engine(database_url, op))

            async def run_async(amount: int) -> dict[str, Any]:
                outcome = await async_engine.run(
                    op, key="k", scope=scope, params={"amount": amount}
                )
                assert outcome.status == 201
                return dict(outcome.body)

            yield name, lambda amount: runner.run(run_async(amount))
            runner.run(async_engine.dispose())
    else:

        @rp.idempotent(engine, key="order_id", scope="tenant", name=name)
        def pay(tenant: str, order_id: str, amount: int) -> dict[str, Any]:
            return {"charge": provider.charge(rp.downstream_key(), amount)}

        yield name, lambda amount: pay(scope, "k", amount)


async def _async_engine(database_url: str, op: rp.Operation[Any]) -> rp.AsyncEngine:
    engine = rp.AsyncEngine(database_url)
    engine.register(op)
    return engine


def fails(call: Call, amount: int) -> None:
    with pytest.raises(rp.Retryable):
        call(amount)


def age(db: sa.Engine, operation: str, by: str) -> None:
    """Move the operation's keys ``by`` (an SQL interval) into the past."""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET created_at = created_at - CAST(:by AS interval), "
                "finished_at = finished_at - CAST(:by AS interval) WHERE operation = :o"
            ),
            {"by": by, "o": operation},
        )


class Snapshot:
    """The key's rows as a failover to a standby that lags behind would find them: taken
    before a claim, put back after it (the claim and all after it lost)."""

    _KEYS = "SELECT row_to_json(k)::text FROM idempotency_keys AS k WHERE operation = :o"
    _GENERATIONS = "SELECT row_to_json(g)::text FROM key_generations AS g WHERE operation = :o"

    def __init__(self, db: sa.Engine, operation: str) -> None:
        self.db, self.operation = db, operation
        with db.connect() as conn:
            self.keys = list(conn.execute(sa.text(self._KEYS), {"o": operation}).scalars())
            self.generations = list(
                conn.execute(sa.text(self._GENERATIONS), {"o": operation}).scalars()
            )

    def restore(self) -> None:
        with self.db.begin() as conn:
            for table, rows in (
                ("idempotency_keys", self.keys),
                ("key_generations", self.generations),
            ):
                conn.execute(
                    sa.text(f"DELETE FROM {table} WHERE operation = :o"), {"o": self.operation}
                )
                for row in rows:
                    conn.execute(
                        sa.text(
                            f"INSERT INTO {table} OVERRIDING SYSTEM VALUE "
                            f"SELECT * FROM json_populate_record(NULL::{table}, CAST(:r AS json))"
                        ),
                        {"r": row},
                    )


def generation(db: sa.Engine, operation: str) -> int:
    with db.connect() as conn:
        found = conn.execute(
            sa.text("SELECT generation FROM idempotency_keys WHERE operation = :o"),
            {"o": operation},
        ).scalar_one()
    return int(found)


@pytest.mark.parametrize("rule", ["reaped", "expired"])
@pytest.mark.slow
def test_a_key_reused_after_its_retention_is_a_new_request_at_the_provider_too(
    engine: rp.Engine,
    db: sa.Engine,
    provider: StrictProvider,
    flavour: tuple[str, Call],
    rule: str,
) -> None:
    name, call = flavour
    first = call(1000)
    assert generation(db, name) == 0
    [first_key] = provider.keys_seen
    age(db, name, "73 hours")
    if rule == "reaped":  # Stripe's rule: the original was pruned
        assert Reaper(engine).run_once().finished >= 1
    # else the IETF draft's: expired, its row still there, deleted by the reuse's claim
    before_claim = Snapshot(db, name)

    # The reuse, with other params; its answer is lost twice after the provider charged.
    provider.fail_after_charge = 2
    fails(call, 2500)
    [reuse_key] = provider.keys_seen[1:]
    assert reuse_key != first_key
    fails(call, 2500)  # a retry: the same downstream key
    assert provider.keys_seen[1:] == [reuse_key, reuse_key]
    assert generation(db, name) == 1

    before_claim.restore()  # a failover loses the reuse's row (and its claim's writes)
    reuse = call(2500)
    assert provider.keys_seen[1:] == [reuse_key] * 3
    assert generation(db, name) == 1
    assert reuse["charge"] != first["charge"]
    assert provider.charges() == {first_key: 1000, reuse_key: 2500}
    if "job" in first:  # the engines' staged jobs: new job keys for the new request
        assert reuse["job"] != first["job"]
    assert call(2500) == reuse  # and it replays in its turn
    assert len(provider.keys_seen) == 4


def test_the_job_keys_of_a_lost_row_are_the_same_again(
    engine: rp.Engine, db: sa.Engine, provider: StrictProvider, scope: str
) -> None:
    name = f"gen_{uuid.uuid4().hex[:10]}"
    op = sync_operation(name, provider)
    engine.register(op)
    engine.run(op, key="k", scope=scope, params={"amount": 1000})
    age(db, name, "73 hours")
    before_claim = Snapshot(db, name)
    reuse = engine.run(op, key="k", scope=scope, params={"amount": 1000})
    before_claim.restore()
    again = engine.run(op, key="k", scope=scope, params={"amount": 1000})
    assert not again.replayed and again.body == reuse.body
    assert len(provider.charges()) == 2


@pytest.mark.slow
def test_a_generation_is_kept_for_the_generations_retention_then_pruned(
    worker_db: sa.Engine, scope: str
) -> None:
    # Its own database: the clock moves every key in it.
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    provider, clock = StrictProvider(worker_db), Clock(worker_db)
    engine = rp.Engine(worker_db)
    op = sync_operation("pruned", provider)
    engine.register(op)
    engine.run(op, key="k", scope=scope, params={"amount": 1000})
    clock.advance(hours=73)
    reaper = Reaper(engine)
    assert reaper.run_once().finished == 1
    clock.advance(days=29)
    assert reaper.run_once().generations == 0  # kept: a provider may still know the key
    engine.run(op, key="k", scope=scope, params={"amount": 2500})
    assert generation(worker_db, "pruned") == 1
    clock.advance(hours=73)
    assert reaper.run_once().finished == 1  # records generation 2
    clock.advance(days=30, seconds=1)
    assert reaper.run_once().generations == 1
    with worker_db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM key_generations")).scalar_one() == 0
    # Pruned: a reuse is generation 0 again, and derives the first request's keys, which
    # every provider has long forgotten (here: they are refused with other params).
    with pytest.raises(Refused):
        engine.run(op, key="k", scope=scope, params={"amount": 3000})
    assert provider.keys_seen[2] == provider.keys_seen[0]


def test_a_generation_is_kept_for_the_longest_registered_dedupe_window(
    worker_db: sa.Engine, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A provider that remembers keys 60 days outlives the reaper's 30-day retention.
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    provider, clock = StrictProvider(worker_db), Clock(worker_db)
    engine = rp.Engine(worker_db)
    op = sync_operation("windowed", provider)
    remembers: rp.Operation[Any] = rp.Operation("remembers")
    remembers.foreign_step("called", dedupe_window=timedelta(days=60))(lambda step, params: None)
    remembers.atomic_phase("finished")(lambda tx, params: rp.Response(201, {}))
    engine.register(op, remembers)
    engine.run(op, key="k", scope=scope, params={"amount": 1000})
    clock.advance(hours=73)
    reaper = Reaper(engine)
    with caplog.at_level("INFO", logger="recoverypoint.workers"):
        assert reaper.run_once().finished == 1
        clock.advance(days=31)
        assert reaper.run_once().generations == 0  # past 30 days, within the window
        clock.advance(days=29, seconds=1)
        assert reaper.run_once().generations == 1
    kept = [r for r in caplog.records if "event=generations_retention" in r.getMessage()]
    assert len(kept) == 1 and f"kept_seconds={60 * 86400}" in kept[0].getMessage()


@pytest.mark.parametrize("action", ["delete", "purge"])
@pytest.mark.slow
def test_a_key_an_operator_deleted_is_a_new_generation(
    engine: rp.Engine, db: sa.Engine, provider: StrictProvider, scope: str, action: str
) -> None:
    name = f"gen_{uuid.uuid4().hex[:10]}"
    op = sync_operation(name, provider)
    engine.register(op)
    first = engine.run(op, key="k", scope=scope, params={"amount": 1000})
    operator = admin.Admin(db, [op])
    if action == "delete":
        [key_id] = admin.list_keys(operator, admin.KeyFilter(operation=name), reveal=True)
        assert admin.delete(operator, key_id.id).changed == (key_id.id,)
    else:
        age(db, name, "4 days")
        assert len(admin.purge(operator, timedelta(days=3)).changed) >= 1
    reuse = engine.run(op, key="k", scope=scope, params={"amount": 2500})
    assert generation(db, name) == 1
    assert reuse.body["job"] != first.body["job"]
    assert len(set(provider.keys_seen)) == 2 and len(provider.charges()) == 2
