"""explore() meets the database's faults too, each a kind of schedule: here, a storm of
serialization failures at a phase (``attempt 1 meets 3 serialization failures at
before_commit:order_priced``), which the engine meets by rolling the phase back and
running it again in the same attempt, with the same params.

The planted mistake: a phase that takes its coupon out of its params (``params.pop``). Run
once per attempt it is right (each attempt loads the params anew from the key's row); run
again after a serialization failure, it finds no coupon and charges the full price. No
crash, raised or dying, finds that: only a storm does. (A first phase runs in the claim's
transaction, which loads the params anew on each run: the coupon is the second's.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.explore import Exploration, explore
from recoverypoint.testing import InjectedConflict, faults, temporary_database

SCHEMA = """
CREATE TABLE priced_orders (key_id bigint NOT NULL, amount integer NOT NULL);
"""
STORM = "client: attempt 1 meets 3 serialization failures at before_commit:order_priced"


@pytest.fixture(scope="module")
def orders_url(server_url: str) -> Iterator[str]:
    with temporary_database(server_url, prefix="rp_explore") as url:
        migrate.upgrade(url)
        db = create_engine(url, poolclass=NullPool)
        with db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        db.dispose()
        yield url


def discounted_once(conn: sa.Connection) -> None:
    """One order, at the price less its coupon."""
    amounts = conn.execute(sa.text("SELECT amount FROM priced_orders")).scalars().all()
    assert amounts == [1500], f"orders at {amounts}, one at 1500 expected"


def explore_orders(url: str, *, pops_the_coupon: bool, **options: Any) -> Exploration:
    engine = rp.Engine(url)
    op: rp.Operation[Any] = rp.Operation("priced_order")

    @op.atomic_phase("order_created")
    def create_order(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.execute("INSERT INTO priced_orders VALUES (%s, %s)", (tx.key_id, params["amount"]))

    @op.atomic_phase("order_priced")
    def price_order(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        coupon = params.pop("coupon", None) if pops_the_coupon else params.get("coupon")
        amount = params["amount"] - (500 if coupon else 0)
        tx.execute("UPDATE priced_orders SET amount = %s WHERE key_id = %s", (amount, tx.key_id))
        return rp.Response(201, {"amount": amount})

    engine.register(op)
    try:
        return explore(
            engine,
            op,
            {"amount": 2000, "coupon": "WELCOME"},
            check=discounted_once,
            tables=["priced_orders"],
            depth=1,
            **options,
        )
    finally:
        engine.dispose()


def test_a_phase_that_changes_its_params_is_found_by_a_storm(orders_url: str) -> None:
    found = explore_orders(orders_url, pops_the_coupon=True)

    assert not found.ok, found.report()
    smallest = found.failures[0]
    assert str(smallest.schedule) == STORM, found.report()
    assert smallest.invariant == "your check discounted_once"
    assert "AssertionError: orders at [2000], one at 1500 expected" in found.report()
    report = found.report()
    assert "1.           serialization failure at before_commit:order_priced: rolled" in report
    assert "ran phase 'order_priced' 4 times: 3 serialization failure(s)" in report
    assert "must not change its params" in report
    # Only the storms broke it: no crash of a process, raised or dying, did.
    assert {f.schedule.crashes[0].effect for f in found.failures} == {"conflict"}
    # The reproduction runs that schedule alone, and fails the same way.
    again = explore_orders(orders_url, pops_the_coupon=True, schedule=STORM)
    assert again.schedules == 1 and again.failures[0].invariant == smallest.invariant


def test_a_phase_that_reads_its_params_passes_every_storm(orders_url: str) -> None:
    found = explore_orders(orders_url, pops_the_coupon=False)

    assert found.ok, found.report()
    # 4 boundaries (2 phases, before and after their commits), raised and died at, each
    # recovered by the client and by the completer; and a storm before each commit, each way.
    assert found.by_depth[1] == 4 * 2 * 2 + 2 * 2
    assert f"every invariant held in {found.schedules} schedules (depth 1)" in found.summary()


def test_without_storms_the_mistake_goes_unseen(orders_url: str) -> None:
    """What explore found before storms were a kind of schedule: every crash passes."""
    found = explore_orders(orders_url, pops_the_coupon=True, effects=("raise", "exit"))
    assert found.ok, found.report()


def test_a_conflict_is_a_serialization_failure_before_a_commit() -> None:
    assert InjectedConflict("x").sqlstate == "40001"
    with pytest.raises(ValueError, match="at before_commit:<point>"):
        faults.arm("after_commit:order_created", effect="conflict")
    with pytest.raises(ValueError, match="'raise', 'exit' or 'conflict'"):
        faults.arm("before_commit:order_priced", effect="storm")  # type: ignore[arg-type]
