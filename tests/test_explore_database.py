"""explore() meets the database's faults too, each a kind of schedule: a storm of
serialization failures at a phase (``attempt 1 meets 3 serialization failures at
before_commit:order_priced``), which the engine meets by rolling the phase back and
running it again in the same attempt, with the same params; and a COMMIT whose answer is
lost (``attempt 1 loses its commit's answer at after_commit:order_placed``): committed,
its caller seeing the connection drop; and the engine's connections ended during a
foreign step (``attempt 1 loses its connections at before_foreign:label_bought``); and a
failover to a standby that lags, which loses the last committed phase (``attempt 1 loses
its last commit to a failover at after_commit:order_created``).

The planted mistake: a phase that takes its coupon out of its params (``params.pop``). Run
once per attempt it is right (each attempt loads the params anew from the key's row); run
again after a serialization failure, it finds no coupon and charges the full price. No
crash, raised or dying, finds that: only a storm does. (A first phase runs in the claim's
transaction, which loads the params anew on each run: the coupon is the second's.)

The planted mistake of a lost answer: code around the engine's call that takes an outage
for a failure, and tells the customer their order was not placed. Only a lost answer
finds it: no other schedule has the engine raise DatabaseUnavailable after a COMMIT.

Connections ended during a step have no planted mistake of the operation's own: code that
keeps a connection or session state from one phase to the next is found by a crash
already (the retry runs in another process, on other connections). What they exercise is
the engine: the phase after the step meets a dead connection, the step's result is
recorded on a new one, and the retry goes on after the step without calling it again.

The planted mistake of a failover: a step whose provider key is made of the key row's id
(``tx.key_id``). After any crash the retry finds the same row, so the key is the same and
the provider dedupes: no other kind finds it. A failover that lost the first phase lost
the key row too: the retry claims the key anew, under another id (a promoted standby's
sequences are not put back), and the provider, asked under a new key, makes a second
label. ``step.downstream_key()`` is derived from the scope, operation, key and the
database's namespace, never from the row, and stays the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from explored import database_with
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.explore import Exploration, Failure, Schedule, explore
from recoverypoint.outage import is_outage
from recoverypoint.testing import InjectedConflict, InjectedLostAnswer, faults

SCHEMA = """
CREATE TABLE priced_orders (key_id bigint NOT NULL, amount integer NOT NULL);
CREATE TABLE placed_orders (key_id bigint NOT NULL);
CREATE TABLE order_notices (notice text NOT NULL);
CREATE TABLE shipped_orders (key_id bigint PRIMARY KEY, label text);
CREATE TABLE labels (downstream_key text PRIMARY KEY);
CREATE TABLE label_requests (downstream_key text NOT NULL);
CREATE TABLE shipment_notices (key_id bigint NOT NULL);
"""
# A row of the application's that refers to the key's, as migration 0011 allows.
KEY_NOTES = """
CREATE TABLE key_notes (key_id bigint NOT NULL, scope text NOT NULL,
                        FOREIGN KEY (key_id, scope) REFERENCES idempotency_keys (id, scope)
                        {deferrable});
"""
STORM = "client: attempt 1 meets 3 serialization failures at before_commit:order_priced"
LOST = "client: attempt 1 loses its commit's answer at after_commit:order_placed"
NOT_PLACED = "your order was not placed"
DROP = "client: attempt 1 loses its connections at before_foreign:label_bought"
TAKEN_OVER = "client: attempt 1 loses its lease at after_foreign:label_bought"
FAILOVER = "client: attempt 1 loses its last commit to a failover at after_commit:order_created"
LAST_LOST = FAILOVER.replace("order_created", "order_shipped")


@pytest.fixture(scope="module")
def orders_url(server_url: str) -> Iterator[str]:
    with database_with(server_url, SCHEMA + KEY_NOTES.format(deferrable="")) as url:
        yield url


def smallest_failure(found: Exploration, schedule: str, invariant: str) -> Failure:
    """The smallest failing schedule, which must be ``schedule``, breaking ``invariant``."""
    assert not found.ok, found.report()
    smallest = found.failures[0]
    assert str(smallest.schedule) == schedule, found.report()
    assert smallest.invariant == invariant, found.report()
    return smallest


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


@pytest.mark.slow
def test_a_phase_that_changes_its_params_is_found_by_a_storm(orders_url: str) -> None:
    found = explore_orders(orders_url, pops_the_coupon=True)

    smallest = smallest_failure(found, STORM, "your check discounted_once")
    report = found.report()
    assert "AssertionError: orders at [2000], one at 1500 expected" in report
    assert "1.           serialization failure at before_commit:order_priced: rolled" in report
    assert "ran phase 'order_priced' 4 times: 3 serialization failure(s)" in report
    assert "must not change its params" in report
    # Only the storms broke it: no crash of a process, raised or dying, did.
    assert {f.schedule.crashes[0].effect for f in found.failures} == {"conflict"}
    # The reproduction runs that schedule alone, and fails the same way.
    again = explore_orders(orders_url, pops_the_coupon=True, schedule=STORM)
    assert again.schedules == 1 and again.failures[0].invariant == smallest.invariant


@pytest.mark.slow
def test_a_phase_that_reads_its_params_passes_every_storm(orders_url: str) -> None:
    found = explore_orders(orders_url, pops_the_coupon=False)

    assert found.ok, found.report()
    # 4 boundaries (2 phases, before and after their commits), raised and died at, each
    # recovered by the client and by the completer; and a storm before each commit and a
    # lost answer and a failover after it, each way.
    assert found.by_depth[1] == 4 * 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2
    assert f"every invariant held in {found.schedules} schedules (depth 1)" in found.summary()


@pytest.mark.slow
def test_without_storms_the_mistake_goes_unseen(orders_url: str) -> None:
    """What explore found before storms were a kind of schedule: every crash passes."""
    found = explore_orders(orders_url, pops_the_coupon=True, effects=("raise", "exit"))
    assert found.ok, found.report()


def test_a_conflict_is_a_serialization_failure_before_a_commit() -> None:
    assert InjectedConflict("x").sqlstate == "40001"
    with pytest.raises(ValueError, match="at before_commit:<point>"):
        faults.arm("after_commit:order_created", effect="conflict")
    with pytest.raises(ValueError, match="'raise', 'exit', 'conflict' or 'lost_answer'"):
        faults.arm("before_commit:order_priced", effect="storm")  # type: ignore[arg-type]


def told_the_truth(conn: sa.Connection) -> None:
    """No customer whose order was placed is told it was not."""
    placed = conn.execute(sa.text("SELECT count(*) FROM placed_orders")).scalar_one()
    notices = conn.execute(sa.text("SELECT notice FROM order_notices")).scalars().all()
    assert placed == 1, f"{placed} orders placed, 1 expected"
    assert NOT_PLACED not in notices, f"the customer was told {notices} of a placed order"


def explore_placing(url: str, *, outage_means_failure: bool, **options: Any) -> Exploration:
    engine = rp.Engine(url)
    op: rp.Operation[Any] = rp.Operation("placed_order")

    @op.atomic_phase("order_placed")
    def place(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.execute("INSERT INTO placed_orders VALUES (%s)", (tx.key_id,))
        return rp.Response(201, {"order": tx.key_id})

    def checkout() -> rp.Outcome:
        """The shop's handler around the engine's call."""
        try:
            return engine.run(op, key="order-1", params={"amount": 2000})
        except rp.DatabaseUnavailable:
            if outage_means_failure:  # the planted mistake: an outage taken for a failure
                with engine.db.begin() as conn:
                    conn.execute(
                        sa.text("INSERT INTO order_notices VALUES (:n)"), {"n": NOT_PLACED}
                    )
            raise  # a 503: the client retries with the same key

    engine.register(op)
    try:
        return explore(
            engine,
            op,
            request=checkout,
            check=told_the_truth,
            tables=["placed_orders", "order_notices"],
            depth=1,
            **options,
        )
    finally:
        engine.dispose()


@pytest.mark.slow
def test_a_caller_that_takes_an_outage_for_a_failure_is_found_by_a_lost_answer(
    orders_url: str,
) -> None:
    found = explore_placing(orders_url, outage_means_failure=True)

    smallest = smallest_failure(found, LOST, "your check told_the_truth")
    report = found.report()
    assert "1.           lost the answer at after_commit:order_placed: committed" in report
    assert "failed: DatabaseUnavailable: the database is unavailable" in report
    assert "an outage does not say that nothing was written" in report
    # Only lost answers broke it: no crash of a process, nor a storm, did.
    assert {f.schedule.crashes[0].effect for f in found.failures} == {"lost_answer"}
    again = explore_placing(orders_url, outage_means_failure=True, schedule=LOST)
    assert again.schedules == 1 and again.failures[0].invariant == smallest.invariant


@pytest.mark.slow
def test_a_caller_that_retries_an_outage_passes_every_lost_answer(orders_url: str) -> None:
    found = explore_placing(orders_url, outage_means_failure=False)

    assert found.ok, found.report()
    # 2 boundaries of its one phase, raised and died at, a storm before its commit and a
    # lost answer and a failover after it, each recovered by the client and by the completer.
    # The failover loses the key row with the answer given from it (order 1): the retry
    # claims the key anew and answers order 2, which a lossy failover allows.
    assert found.by_depth[1] == (2 * 2 + 1 + 1 + 1) * 2


@pytest.mark.slow
def test_without_lost_answers_the_mistake_goes_unseen(orders_url: str) -> None:
    found = explore_placing(
        orders_url, outage_means_failure=True, effects=("raise", "exit", "conflict")
    )
    assert found.ok, found.report()


def test_a_lost_answer_is_an_outage_after_a_commit() -> None:
    lost = InjectedLostAnswer("x")
    assert isinstance(lost, psycopg.OperationalError) and is_outage(lost)
    with pytest.raises(ValueError, match="at after_commit:<point>"):
        faults.arm("before_commit:order_placed", effect="lost_answer")


def labelled_once(conn: sa.Connection) -> None:
    """One order, shipped with the one label the provider made."""
    shipped = conn.execute(sa.text("SELECT label FROM shipped_orders")).scalars().all()
    labels = conn.execute(sa.text("SELECT downstream_key FROM labels")).scalars().all()
    assert len(labels) == 1 and shipped == labels, f"orders {shipped}, labels {labels}"


def asked_once(conn: sa.Connection) -> None:
    """The provider was asked for a label once."""
    asked = conn.execute(sa.text("SELECT count(*) FROM label_requests")).scalar_one()
    assert asked == 1, f"the provider was asked {asked} times"


def always_shown(conn: sa.Connection) -> None:
    raise AssertionError("shown")


def explore_shipping(
    url: str,
    *,
    key_of_the_row: bool = False,
    the_step_answers: bool = False,
    notes_the_key: bool = False,
    **options: Any,
) -> Exploration:
    engine = rp.Engine(url)
    provider = create_engine(url, poolclass=NullPool)  # the label provider's own database
    op: rp.Operation[Any] = rp.Operation("shipped_order")

    @op.atomic_phase("order_created")
    def create_order(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.execute("INSERT INTO shipped_orders (key_id) VALUES (%s)", (tx.key_id,))
        if notes_the_key:
            tx.execute("INSERT INTO key_notes VALUES (%s, '')", (tx.key_id,))

    @op.foreign_step("label_bought")
    def buy_label(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any] | rp.Response:
        # The planted mistake of a failover: a provider key made of the key row.
        key = f"order-{step.key_id}" if key_of_the_row else step.downstream_key()
        with provider.begin() as conn:  # a provider that dedupes on the key it is given
            conn.execute(sa.text("INSERT INTO label_requests VALUES (:k)"), {"k": key})
            conn.execute(
                sa.text("INSERT INTO labels VALUES (:k) ON CONFLICT DO NOTHING"), {"k": key}
            )
        # Answering, the step finishes the key: its result is committed alone.
        return rp.Response(201, {"label": key}) if the_step_answers else {"label": key}

    @op.atomic_phase("order_shipped")
    def ship(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        label = tx.state["label"]
        tx.execute("UPDATE shipped_orders SET label = %s WHERE key_id = %s", (label, tx.key_id))
        tx.execute("INSERT INTO shipment_notices VALUES (%s)", (tx.key_id,))
        return rp.Response(201, {"order": tx.key_id})

    engine.register(op)
    options.setdefault("check", labelled_once)
    try:
        return explore(
            engine,
            op,
            {"weight": 2},
            tables=[
                "shipped_orders",
                "labels",
                "label_requests",
                "shipment_notices",
                *(["key_notes"] if notes_the_key else []),
            ],
            dispose=[provider],
            depth=1,
            **options,
        )
    finally:
        engine.dispose()
        provider.dispose()


@pytest.mark.slow
def test_connections_ended_during_a_step_are_recovered_from(orders_url: str) -> None:
    found = explore_shipping(orders_url)

    assert found.ok, found.report()
    # 6 boundaries (2 commits and their after_commits, 2 around the step), raised and died
    # at; a storm before each commit, a lost answer and a failover after each, and the
    # connections ended during the step and its lease run out as it returned; each
    # recovered by the client and by the completer. The step passes every failover too:
    # it hands the provider step.downstream_key().
    assert found.by_depth[1] == (6 * 2 + 2 + 2 + 2 + 1 + 1) * 2


@pytest.mark.parametrize("schedule", [DROP, DROP.replace("client", "completer")])
@pytest.mark.slow
def test_a_step_whose_connections_end_is_called_once(orders_url: str, schedule: str) -> None:
    """The phase after the step meets a dead connection: the attempt fails with an outage,
    having recorded the step's result on a new connection, and the recovery goes on from
    the step's result, not calling it again."""
    found = explore_shipping(orders_url, schedule=schedule, check=[labelled_once, asked_once])
    assert found.ok, found.report()

    # What each attempt did, as a report tells it: shown by a check that always fails.
    drops = explore_shipping(orders_url, schedule=schedule, check=always_shown)
    story = "\n".join(drops.failures[0].story)
    assert "1.           its connections ended at before_foreign:label_bought: 1 " in story
    assert "1. client    failed: DatabaseUnavailable: the database is unavailable" in story
    report = drops.report()
    assert "the engine's connections were ended at before_foreign:label_bought" in report


def noticed_once(conn: sa.Connection) -> None:
    """The customer was told once that their order shipped."""
    notices = conn.execute(sa.text("SELECT count(*) FROM shipment_notices")).scalar_one()
    assert notices == 1, f"the customer was told {notices} times"


def asked_twice(conn: sa.Connection) -> None:
    """The provider was asked twice, with one downstream key: by the attempt whose lease
    ran out and by the one that took the key over."""
    asked = conn.execute(sa.text("SELECT DISTINCT downstream_key FROM label_requests"))
    count = conn.execute(sa.text("SELECT count(*) FROM label_requests")).scalar_one()
    assert count == 2 and len(asked.all()) == 1, f"the provider was asked {count} times"


@pytest.mark.parametrize("schedule", [TAKEN_OVER, TAKEN_OVER.replace("client", "completer")])
@pytest.mark.slow
def test_a_step_whose_lease_runs_out_is_fenced(orders_url: str, schedule: str) -> None:
    """Its step returned, the attempt finds its lease ran out and the key taken over and
    finished meanwhile: recording the step's result, its fence refuses (LockLost), and
    the phase after the step commits once, the provider having deduped the second call."""
    checks = [labelled_once, asked_twice, noticed_once]
    found = explore_shipping(orders_url, schedule=schedule, check=checks)
    assert found.ok, found.report()

    taken = explore_shipping(orders_url, schedule=schedule, check=always_shown)
    story = "\n".join(taken.failures[0].story)
    assert (
        "1.           its lease ran out while its step ran, at after_foreign:label_bought: "
        "attempt 2 takes the key over" in story
    )
    assert "1. client    failed: LockLost" in story


@pytest.mark.slow
def test_a_key_made_of_the_key_row_is_found_by_a_failover_only(orders_url: str) -> None:
    found = explore_shipping(orders_url, key_of_the_row=True)

    smallest = smallest_failure(found, FAILOVER, "your check labelled_once")
    report = found.report()
    assert "labels ['order-1', 'order-2']" in report
    story = "\n".join(smallest.story)
    assert "1.           committed at after_commit:order_created, not yet on the standby" in story
    assert "1.           the primary fails at before_commit:order_shipped" in story
    assert "1. client    died with the primary: shipped_orders, idempotency_keys back as" in story
    assert "lost to a failover" in report and "step.downstream_key()" in report
    # Only a failover that lost the key row broke it: no crash, storm, lost answer, dropped
    # connection or lease run out did, nor the loss of the last phase (the row stayed).
    assert [str(f.schedule) for f in found.failures] == [
        FAILOVER,
        FAILOVER.replace("client", "completer"),
    ]
    # The reproduction runs that schedule alone, and fails the same way.
    assert Schedule.parse(FAILOVER) == smallest.schedule
    again = explore_shipping(orders_url, key_of_the_row=True, schedule=FAILOVER)
    assert again.schedules == 1 and again.failures[0].invariant == smallest.invariant


def claimed_again(conn: sa.Connection) -> None:
    """The failover lost the key row and the order: the ones left are the retry's, under
    the next id (a promoted standby's sequences are not put back)."""
    keys = conn.execute(sa.text("SELECT id FROM idempotency_keys")).scalars().all()
    orders = conn.execute(sa.text("SELECT key_id FROM shipped_orders")).scalars().all()
    assert keys == orders == [2], f"keys {keys}, orders {orders}"


@pytest.mark.parametrize("schedule", [FAILOVER, FAILOVER.replace("client", "completer")])
def test_a_failover_puts_the_database_back_and_the_provider_dedupes(
    orders_url: str, schedule: str
) -> None:
    """The retry finds the database as before the lost commit, the provider as the step
    left it: the order made anew, the step called again with the same downstream key, one
    label."""
    checks = [labelled_once, asked_twice, noticed_once, claimed_again]
    found = explore_shipping(orders_url, schedule=schedule, check=checks)
    assert found.ok, found.report()


@pytest.mark.slow
def test_an_answer_given_before_a_failover_is_lost_with_it(orders_url: str) -> None:
    """The attempt answered, then its last phase was lost: the retry's answer is the one
    replayed. A lossy failover may lose an answer (docs/how-to/production.md): it is told,
    not compared. One that loses the first phase has the key claimed anew: the retry's
    answer names another order."""
    last = explore_shipping(orders_url, schedule=LAST_LOST, check=always_shown)
    story = "\n".join(last.failures[0].story)
    assert '1. client    answered 201 {"order": 1}' in story
    assert "1.           the primary fails as the attempt ends: its standby is promoted" in story
    assert '   lost with it: the answer 201 {"order": 1}' in story
    assert '2. client    answered 201 {"order": 1}' in story  # resumed after order_created

    first = explore_shipping(orders_url, schedule=FAILOVER, check=always_shown)
    story = "\n".join(first.failures[0].story)
    assert "1.           the primary fails at before_commit:order_shipped" in story
    assert '2. client    answered 201 {"order": 2}' in story


def test_a_failover_is_written_after_a_commit(orders_url: str) -> None:
    """A failover loses a commit: written anywhere else, it is the caller's mistake, told
    before anything runs."""
    misplaced = FAILOVER.replace("after_commit:order_created", "before_foreign:label_bought")
    with pytest.raises(ValueError, match="comes after one: write it at after_commit:<phase>"):
        explore_shipping(orders_url, schedule=misplaced)


def labelled(conn: sa.Connection) -> None:
    """The provider made one label."""
    labels = conn.execute(sa.text("SELECT count(*) FROM labels")).scalar_one()
    assert labels == 1, f"{labels} labels"


@pytest.mark.slow
def test_a_failover_loses_a_step_s_result_committed_alone(orders_url: str) -> None:
    """A step that answers finishes the key in a commit of its own, which a failover loses:
    the key is back at the phase before it, and the retry calls the step again with the
    same downstream key; the answer given before is lost with it."""
    answered = FAILOVER.replace("order_created", "label_bought")
    found = explore_shipping(
        orders_url, the_step_answers=True, schedule=answered, check=[labelled, asked_twice]
    )
    assert found.ok, found.report()

    shown = explore_shipping(
        orders_url, the_step_answers=True, schedule=answered, check=always_shown
    )
    story = "\n".join(shown.failures[0].story)
    assert "1.           the primary fails as the attempt ends" in story
    assert "1. client    died with the primary: idempotency_keys back as" in story
    assert "   lost with it: the answer 201 {" in story


def test_a_failover_puts_back_a_key_row_that_a_row_of_yours_refers_to(orders_url: str) -> None:
    """Losing the last phase puts the key row back while a row of the first phase refers
    to it: as a standby replays its log, no foreign key is checked meanwhile."""
    found = explore_shipping(
        orders_url,
        notes_the_key=True,
        schedule=LAST_LOST,
        check=[labelled_once, asked_twice, noticed_once],
    )
    assert found.ok, found.report()


@pytest.fixture
def unprivileged(server_url: str) -> Iterator[str]:
    """A server URL whose role may create databases and nothing more: no superuser."""
    role = f"rp_explorer_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN CREATEDB")
    try:
        yield sa.make_url(server_url).set(username=role).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


@pytest.mark.parametrize("deferrable", [True, False])
@pytest.mark.slow
def test_without_privilege_a_deferrable_foreign_key_is_needed(
    unprivileged: str, deferrable: bool
) -> None:
    """A role that may not set session_replication_role puts the rows back with the
    foreign keys checked: a DEFERRABLE one at the COMMIT, the rows back by then; another
    stops the exploration with what to do."""
    schema = SCHEMA + KEY_NOTES.format(deferrable="DEFERRABLE" * deferrable)
    with database_with(unprivileged, schema) as url:
        if deferrable:
            found = explore_shipping(url, notes_the_key=True, schedule=LAST_LOST)
            assert found.ok, found.report()
            return
        with pytest.raises(ValueError, match="Make that foreign key DEFERRABLE") as refused:
            explore_shipping(url, notes_the_key=True, schedule=LAST_LOST)
        assert "violates foreign key constraint" in str(refused.value)
