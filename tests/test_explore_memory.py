"""explore() recovers each key in another process than the attempt that crashed, as
production does (the client's retry reaches another server, the completer is a process
of its own): an operation that hands a value from one phase to the next in process memory
instead of ``tx.state`` is found, and the report says so.

The operation is a wallet top-up: the card is debited, then the wallet credited with the
debit's id. The careless one keeps that id in a module-level dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from docs_snippets import section
from explored import database_with

import recoverypoint as rp
from recoverypoint.explore import Exploration, explore

pytestmark = pytest.mark.slow  # explorations of every schedule

SCHEMA = """
CREATE TABLE debits (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key_id bigint NOT NULL);
CREATE TABLE credits (debit_id bigint NOT NULL);
"""
TABLES = ("credits", "debits")
BLOCKS = [b.body for b in section("how-to/testing.md", "Prove your operation crash-safe")]

# The mistake: what the debit phase hands to the credit phase, kept in process memory.
debited: dict[int, int] = {}


@pytest.fixture(scope="module")
def wallet_url(server_url: str) -> Iterator[str]:
    with database_with(server_url, SCHEMA) as url:
        yield url


def credited_once(conn: sa.Connection) -> None:
    """One debit, and the wallet credited with it once."""
    debits = conn.execute(sa.text("SELECT id FROM debits")).scalars().all()
    credits = conn.execute(sa.text("SELECT debit_id FROM credits")).scalars().all()
    assert len(debits) == 1, f"{len(debits)} debits for one top-up"
    assert credits == debits, f"credits {credits} for debits {debits}"


def explore_wallet(url: str, *, in_memory: bool, **options: Any) -> Exploration:
    engine = rp.Engine(url)
    op: rp.Operation[Any] = rp.Operation("top_up")

    @op.atomic_phase("card_debited")
    def debit(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        debit_id = tx.scalar("INSERT INTO debits (key_id) VALUES (%s) RETURNING id", (tx.key_id,))
        if in_memory:
            debited[tx.key_id] = debit_id
        else:
            tx.state["debit_id"] = debit_id

    @op.atomic_phase("wallet_credited")
    def credit(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        debit_id = debited[tx.key_id] if in_memory else tx.state["debit_id"]
        tx.execute("INSERT INTO credits (debit_id) VALUES (%s)", (debit_id,))
        return rp.Response(201, {"debit_id": debit_id})

    engine.register(op)
    try:
        return explore(engine, op, {}, check=credited_once, tables=TABLES, **options)
    finally:
        engine.dispose()


def test_a_value_kept_in_process_memory_between_phases_is_found(wallet_url: str) -> None:
    debited.clear()
    found = explore_wallet(wallet_url, in_memory=True)

    assert not found.ok, found.report()
    smallest = found.failures[0]
    assert str(smallest.schedule) == "client: attempt 1 raises at after_commit:card_debited"
    assert smallest.invariant == "the key finishes", found.report()
    report = found.report()
    assert "stopped at card_debited; last error: KeyError: 1" in report
    assert (
        "why: a value read by `wallet_credited` was not in `tx.state` after attempt 1 "
        "raised at after_commit:card_debited" in report
    ), report
    # The hint, as docs/how-to/testing.md shows it.
    shown = next(b for b in BLOCKS if b.startswith("why: a value read by"))
    assert " ".join(shown.split()) in " ".join(report.split()), report
    # The search stopped at the first depth with a failure, and says so.
    assert found.reached == 1
    assert "(depth 1, " in found.summary()
    # Explore's own process never ran the operation: nothing reached its memory.
    assert debited == {}
    # The reproduction fails the same way, with the same hint.
    again = explore_wallet(wallet_url, in_memory=True, schedule=str(smallest.schedule))
    assert again.failures[0].hints == smallest.hints


def test_a_value_handed_on_in_tx_state_passes(wallet_url: str) -> None:
    found = explore_wallet(wallet_url, in_memory=False, depth=1)

    assert found.ok, found.report()
    # 4 boundaries (2 phases, before and after their commits), raised and died at, each
    # recovered by the client and by the completer; a storm before each commit and a lost
    # answer and a failover after it, each way.
    assert found.by_depth[1] == 4 * 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2
    assert f"every invariant held in {found.schedules} schedules (depth 1)" in found.summary()


def test_a_mistake_in_the_code_itself_is_not_blamed_on_process_memory(wallet_url: str) -> None:
    """A phase that fails whichever process runs it: no hint about process memory."""
    engine = rp.Engine(wallet_url)
    op: rp.Operation[Any] = rp.Operation("top_up_typo")

    @op.atomic_phase("card_debited")
    def debit(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.state["debit_id"] = tx.scalar(
            "INSERT INTO debits (key_id) VALUES (%s) RETURNING id", (tx.key_id,)
        )

    @op.atomic_phase("wallet_credited")
    def credit(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        # Fails once recovered, wherever: the mistake is the code's, not process memory's.
        attempts = tx.scalar("SELECT attempts FROM idempotency_keys WHERE id = %s", (tx.key_id,))
        if attempts > 1:
            raise LookupError("no such wallet")
        tx.execute("INSERT INTO credits (debit_id) VALUES (%s)", (tx.state["debit_id"],))
        return rp.Response(201, {})

    engine.register(op)
    try:
        found = explore(engine, op, {}, check=credited_once, tables=TABLES, depth=1)
    finally:
        engine.dispose()

    assert not found.ok
    assert "LookupError: no such wallet" in found.report()
    assert "Process memory" not in found.report()
