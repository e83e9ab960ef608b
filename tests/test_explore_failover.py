"""explore() meets a failover that loses the last committed phase: an asynchronous standby
that lagged is promoted (``attempt 1 loses its last commit to a failover at
after_commit:order_created``). The attempt commits the phase and goes on, its foreign step
reaching the provider; at its next COMMIT the primary is gone, its process with it, and the
database is back as it was before the phase's commit, key row and the phase's own rows
together, while the provider keeps what the step did. The retry runs the phase and the
step again.

The planted mistake: a step whose provider key is made of the order's id, which the first
phase got from a serial column and handed on in ``tx.state``. After any crash the retry
reads the same id from the state, so the key is the same and the provider dedupes: no
other kind finds it. After a failover that lost the phase, the retry makes the order anew
and gets another id: the provider, asked under a new key, makes a second label.
``step.downstream_key()`` is derived from the scope, operation, key and the database's
namespace, never from a row, and stays the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from explored import database_with
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.explore import Exploration, Schedule, explore

SCHEMA = """
CREATE TABLE orders (id bigserial PRIMARY KEY, label text);
CREATE TABLE labels (provider_key text PRIMARY KEY);
CREATE TABLE label_requests (provider_key text NOT NULL);
"""
FIRST = "client: attempt 1 loses its last commit to a failover at after_commit:order_created"
LAST = "client: attempt 1 loses its last commit to a failover at after_commit:order_shipped"


@pytest.fixture(scope="module")
def shop_url(server_url: str) -> Iterator[str]:
    with database_with(server_url, SCHEMA) as url:
        yield url


def labelled_once(conn: sa.Connection) -> None:
    """One order, shipped with the one label the provider made."""
    shipped = conn.execute(sa.text("SELECT label FROM orders")).scalars().all()
    labels = conn.execute(sa.text("SELECT provider_key FROM labels")).scalars().all()
    assert len(labels) == 1 and shipped == labels, f"orders {shipped}, labels {labels}"


def made_again(conn: sa.Connection) -> None:
    """The failover lost the first order: the one left is the retry's, with the next id
    (a promoted standby's sequences are not put back); the provider was asked twice."""
    ids = conn.execute(sa.text("SELECT id FROM orders")).scalars().all()
    asked = conn.execute(sa.text("SELECT count(*) FROM label_requests")).scalar_one()
    assert ids == [2] and asked == 2, f"orders {ids}, the provider asked {asked} times"


def explore_shop(url: str, *, key_of_the_order: bool, **options: Any) -> Exploration:
    engine = rp.Engine(url)
    provider = create_engine(url, poolclass=NullPool)  # the label provider's own database
    op: rp.Operation[Any] = rp.Operation("labelled_order")

    @op.atomic_phase("order_created")
    def create_order(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.state["order"] = tx.execute("INSERT INTO orders DEFAULT VALUES RETURNING id").fetchone()[
            0
        ]

    @op.foreign_step("label_bought")
    def buy_label(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        # The planted mistake: a key made of what the lost phase wrote.
        key = f"order-{step.state['order']}" if key_of_the_order else step.downstream_key()
        with provider.begin() as conn:  # a provider that dedupes on the key it is given
            conn.execute(sa.text("INSERT INTO label_requests VALUES (:k)"), {"k": key})
            conn.execute(
                sa.text("INSERT INTO labels VALUES (:k) ON CONFLICT DO NOTHING"), {"k": key}
            )
        return {"label": key}

    @op.atomic_phase("order_shipped")
    def ship(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        order, label = tx.state["order"], tx.state["label"]
        tx.execute("UPDATE orders SET label = %s WHERE id = %s", (label, order))
        return rp.Response(201, {"order": order})

    engine.register(op)
    options.setdefault("check", labelled_once)
    try:
        return explore(
            engine,
            op,
            {"weight": 2},
            tables=["orders", "labels", "label_requests"],
            dispose=[provider],
            depth=1,
            **options,
        )
    finally:
        engine.dispose()
        provider.dispose()


def test_a_key_made_of_a_lost_row_is_found_by_a_failover_only(shop_url: str) -> None:
    found = explore_shop(shop_url, key_of_the_order=True)

    assert not found.ok, found.report()
    smallest = found.failures[0]
    assert str(smallest.schedule) == FIRST, found.report()
    assert smallest.invariant == "your check labelled_once"
    report = found.report()
    assert "labels ['order-1', 'order-2']" in report
    story = "\n".join(smallest.story)
    assert "1.           committed at after_commit:order_created, not yet on the standby" in story
    assert "1.           the primary fails at before_commit:order_shipped" in story
    assert "1. client    died with the primary: orders, idempotency_keys back as" in story
    assert "lost to a failover" in report and "step.downstream_key()" in report
    # Only a failover that lost the order's phase broke it: no crash, storm, lost answer,
    # dropped connection or lease run out did, nor the loss of the last phase (the
    # order's id was in the state it resumed from).
    assert [str(f.schedule) for f in found.failures] == [
        FIRST,
        FIRST.replace("client", "completer"),
    ]
    # The reproduction runs that schedule alone, and fails the same way.
    assert Schedule.parse(FIRST) == smallest.schedule
    again = explore_shop(shop_url, key_of_the_order=True, schedule=FIRST)
    assert again.schedules == 1 and again.failures[0].invariant == smallest.invariant


def test_the_downstream_key_passes_every_failover(shop_url: str) -> None:
    found = explore_shop(shop_url, key_of_the_order=False)

    assert found.ok, found.report()
    # 6 boundaries (2 commits and their after_commits, 2 around the step), raised and died
    # at; a storm before each commit; a lost answer and a failover after each; the
    # connections ended during the step and its lease run out as it returned; each
    # recovered by the client and by the completer.
    assert found.by_depth[1] == (6 * 2 + 2 + 2 + 2 + 1 + 1) * 2


@pytest.mark.parametrize("schedule", [FIRST, FIRST.replace("client", "completer")])
def test_a_failover_puts_the_database_back_and_the_provider_dedupes(
    shop_url: str, schedule: str
) -> None:
    """What the retry finds: the order made anew under the next id, the step called again
    with the same downstream key, one label."""
    found = explore_shop(
        shop_url, key_of_the_order=False, schedule=schedule, check=[labelled_once, made_again]
    )
    assert found.ok, found.report()


def test_an_answer_given_before_a_failover_is_lost_with_it(shop_url: str) -> None:
    """The attempt answered (order 1), then its last phase was lost: the retry's answer is
    the one replayed. A lossy failover may lose an answer (docs/how-to/production.md):
    it is told, not compared. A failover that loses the first phase has the order made
    anew: the retry's answer names another."""

    def always_shown(conn: sa.Connection) -> None:
        raise AssertionError("shown")

    shown = explore_shop(shop_url, key_of_the_order=False, schedule=LAST, check=always_shown)
    failure = shown.failures[0]
    assert failure.invariant == "your check always_shown", shown.report()
    story = "\n".join(failure.story)
    assert '1. client    answered 201 {"order": 1}' in story
    assert "1.           the primary fails as the attempt ends: its standby is promoted" in story
    assert '   lost with it: the answer 201 {"order": 1}' in story
    assert '2. client    answered 201 {"order": 1}' in story  # resumed after order_created

    first = explore_shop(shop_url, key_of_the_order=False, schedule=FIRST, check=always_shown)
    story = "\n".join(first.failures[0].story)
    assert "1.           the primary fails at before_commit:order_shipped" in story
    assert '2. client    answered 201 {"order": 2}' in story  # the order made anew
