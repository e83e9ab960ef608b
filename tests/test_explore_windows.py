"""explore() and a provider's dedupe window: a foreign step that declares one is also
crashed around in schedules whose recovery comes after the window has passed. With a
reconcile hook the key finishes with one charge; without one it waits for an operator
(needs-reconciliation), which the report counts and says what to do about; in neither is
the step called blindly again, and an engine that would is reported.

The provider is the shop's of test_explore (charges in a table); it never forgets a key,
so that a blind call past the window would not charge twice: explore itself must see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from test_explore import SCHEMA, Provider

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.engine.run import _Run
from recoverypoint.explore import Exploration, Schedule, explore
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # explorations of every schedule

WINDOW = timedelta(hours=24)
TABLES = ("orders", "order_audit", "charges", "receipts")
FOUND = "finished: its reconcile hook found the call"
ANEW = "finished: called anew, its reconcile hook having found nothing"
HELD = "needs reconciliation"
# Without crashes, the shop reaches 6 boundaries (2 phases, before and after their commit,
# and the step's 2); each is raised and died at, each recovered by the client and by the
# completer, with a storm of serialization failures before each commit, a lost answer and a
# failover after it and the connections ended during the step too; of the crashes raised
# and died, the 2 around the step again with recovery past the window.
ORDINARY, LATE = 6 * 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2 + 2 + 2, 2 * 2 * 2


@pytest.fixture(scope="module")
def shop_url(server_url: str) -> Iterator[str]:
    with temporary_database(server_url, prefix="rp_explore") as url:
        migrate.upgrade(url)
        db = create_engine(url)
        with db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        db.dispose()
        yield url


def charged_once(conn: sa.Connection) -> None:
    """One order, with the one charge the provider made."""
    charges = conn.execute(sa.text("SELECT id FROM charges")).scalars().all()
    assert len(charges) == 1, f"{len(charges)} charges for one order"
    orders = conn.execute(sa.text("SELECT charge_id FROM orders")).scalars().all()
    assert orders == charges, f"orders hold charges {orders}, the provider {charges}"


@pytest.fixture
def shop(shop_url: str) -> Iterator[Any]:
    made: list[tuple[rp.Engine, sa.Engine]] = []

    def make(*, hook: bool) -> Any:
        outside = create_engine(shop_url)  # the provider's connections
        provider = Provider(outside, dedupe=True)
        engine = rp.Engine(shop_url)
        made.append((engine, outside))
        op: rp.Operation[Any] = rp.Operation("windowed_checkout")

        @op.atomic_phase("order_created")
        def create_order(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
            tx.state["order_id"] = tx.scalar(
                "INSERT INTO orders (key_id) VALUES (%s) RETURNING id", (tx.key_id,)
            )

        def find(step: rp.StepContext, params: dict[str, Any]) -> Any:
            charge_id = provider.find(step.downstream_key())
            return rp.NotFound if charge_id is None else {"charge_id": charge_id}

        @op.foreign_step("charged", dedupe_window=WINDOW, reconcile=find if hook else None)
        def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
            return {"charge_id": provider.charge(step.downstream_key(), params["amount"])}

        @op.atomic_phase("finished")
        def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
            tx.execute(
                "UPDATE orders SET charge_id = %s WHERE id = %s",
                (tx.state["charge_id"], tx.state["order_id"]),
            )
            return rp.Response(201, {"order_id": tx.state["order_id"]})

        engine.register(op)

        def run(**options: Any) -> Exploration:
            return explore(
                engine,
                op,
                {"amount": 2000},
                check=charged_once,
                tables=TABLES,
                dispose=[outside],
                depth=1,
                **options,
            )

        return run

    yield make
    for engine, outside in made:
        engine.dispose()
        outside.dispose()


def late(crash: str) -> str:
    return f"{crash}; past the window of charged"


def test_with_a_hook_every_key_past_the_window_finishes_charged_once(shop: Any) -> None:
    explored = shop(hook=True)
    found = explored()

    assert found.ok, found.report()
    assert found.by_depth[1] == ORDINARY + LATE
    assert found.held == 0
    # After the call: the hook finds its charge. Before it: the hook finds nothing, and
    # the step is called anew (charged_once saw the one charge each time).
    for way in ("client", "completer"):
        for verb in ("raises", "dies"):
            crash = f"{way}: attempt 1 {verb} at"
            assert found.past_window[late(f"{crash} after_foreign:charged")] == FOUND
            assert found.past_window[late(f"{crash} before_foreign:charged")] == ANEW
    assert len(found.past_window) == LATE
    assert "needs-reconciliation" not in found.report()
    assert f"{LATE} schedules (4 {ANEW}, 4 {FOUND})" in found.report()
    # Deterministic: the same schedules, the same outcomes, the same report.
    again = explored()
    assert again.past_window == found.past_window
    assert again.report().split("\n")[1:] == found.report().split("\n")[1:]


def test_without_a_hook_the_key_waits_for_an_operator_and_the_step_is_not_called_again(
    shop: Any, shop_url: str
) -> None:
    explored = shop(hook=False)
    found = explored()

    assert found.ok, found.report()
    assert found.by_depth[1] == ORDINARY + LATE
    assert set(found.past_window.values()) == {HELD} and found.held == LATE
    report = found.report()
    assert f"{LATE} left the key in the state needs-reconciliation" in report
    assert "recoverypoint keys reconcile ID --found JSON` or `--not-found`" in report

    # What one such schedule leaves (the next schedule empties the tables first).
    one = explored(schedule=late("completer: attempt 1 dies at after_foreign:charged"))
    assert one.ok and one.held == 1
    db = create_engine(shop_url)
    try:
        with db.connect() as conn:
            key = conn.execute(
                sa.text("SELECT reconcile_since, lock_token, recovery_point FROM idempotency_keys")
            ).one()
            charges = conn.scalar(sa.text("SELECT count(*) FROM charges"))
    finally:
        db.dispose()
    assert key.reconcile_since is not None and key.lock_token is None
    assert key.recovery_point == "order_created"
    assert charges == 1  # called once, before the crash: never again


@pytest.mark.parametrize("hook", [True, False])
def test_an_engine_that_calls_the_step_blindly_past_the_window_is_reported(
    shop: Any, hook: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Run, "_past_window", lambda self, phase: False)

    found = shop(hook=hook)()

    assert not found.ok
    smallest = found.failures[0]
    assert str(smallest.schedule) == late("client: attempt 1 raises at before_foreign:charged")
    assert smallest.invariant == (
        "past its provider's dedupe window, a step is not called blindly again"
    )
    assert "foreign step 'charged' was called 1 time(s) after" in smallest.detail
    assert "past the dedupe window of charged" in "\n".join(smallest.story)
    # Every ordinary schedule held: only those past the window broke.
    assert all(f.schedule.past_window == "charged" for f in found.failures)


def test_a_window_schedule_reads_back_and_names_a_windowed_step(shop: Any) -> None:
    text = late("client: attempt 1 dies at before_foreign:charged") + "; attempt 2 raises at x:y"
    assert str(Schedule.parse(text)) == text
    assert Schedule.parse("client: past the window of charged").past_window == "charged"
    with pytest.raises(ValueError, match="'order_created' is not a foreign step"):
        shop(hook=False)(schedule=late("client: no crash").replace("charged", "order_created"))
