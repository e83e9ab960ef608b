"""explore(): every crash schedule of an operation, and the mistakes it must find.

Each broken shop below carries one mistake a user makes; explore must report it with the
smallest schedule that shows it. The correct shop passes every schedule to depth 2.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from explored import database_with
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.explore import Crash, Exploration, Schedule, Subject, explore
from recoverypoint.jobs import InProcessBackend, Job, consume_once

pytestmark = pytest.mark.slow  # explorations of every schedule

SCHEMA = """
CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                     key_id bigint NOT NULL, charge_id bigint);
CREATE TABLE order_audit (key_id bigint NOT NULL);
CREATE TABLE charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                      idempotency_key text, amount integer NOT NULL);
CREATE TABLE receipts (job_key text NOT NULL);
"""
TABLES = ("orders", "order_audit", "charges", "receipts")


@pytest.fixture(scope="module")
def shop_url(server_url: str) -> Iterator[str]:
    with database_with(server_url, SCHEMA) as url:
        yield url


@dataclass(frozen=True)
class Mistakes:
    no_downstream_key: bool = False
    provider_ignores_keys: bool = False
    second_connection: bool = False
    consumer_ignores_job_key: bool = False
    step_skips_when_done: bool = False
    provider_unreachable: bool = False


class Provider:
    """A payment provider in the database: a charge with a key it knows returns the first
    (unless ``dedupe`` is off, a provider that ignores idempotency keys)."""

    def __init__(self, db: sa.Engine, dedupe: bool) -> None:
        self.db = db
        self.dedupe = dedupe

    def find(self, key: str) -> int | None:
        with self.db.connect() as conn:
            found = conn.scalar(
                sa.text("SELECT id FROM charges WHERE idempotency_key = :k"), {"k": key}
            )
        return None if found is None else int(found)

    def charge(self, key: str | None, amount: int) -> int:
        known = self.find(key) if key is not None and self.dedupe else None
        if known is not None:
            return known
        with self.db.begin() as conn:
            return int(
                conn.scalar(
                    sa.text(
                        "INSERT INTO charges (idempotency_key, amount) VALUES (:k, :a) RETURNING id"
                    ),
                    {"k": key, "a": amount},
                )
            )


def one_of_each(conn: sa.Connection) -> None:
    """The shop's invariant: one order, charged once, with its charge, one receipt."""
    charges = conn.execute(sa.text("SELECT id FROM charges")).scalars().all()
    assert len(charges) == 1, f"{len(charges)} charges for one order"
    orders = conn.execute(sa.text("SELECT charge_id FROM orders")).scalars().all()
    assert orders == charges, f"orders hold charges {orders}, the provider {charges}"
    audits = conn.scalar(sa.text("SELECT count(*) FROM order_audit"))
    assert audits == 1, f"{audits} audit rows for one order"
    receipts = conn.scalar(sa.text("SELECT count(*) FROM receipts"))
    assert receipts == 1, f"{receipts} receipts for one order"


@dataclass
class Shop:
    engine: rp.Engine
    operation: rp.Operation[Any]
    outside: sa.Engine

    def explore(self, **options: Any) -> Exploration:
        return explore(
            self.engine,
            self.operation,
            {"amount": 2000},
            check=one_of_each,
            tables=TABLES,
            dispose=[self.outside],
            **options,
        )


@pytest.fixture
def make_shop(shop_url: str) -> Iterator[Any]:
    made: list[Shop] = []

    def make(mistakes: Mistakes = Mistakes()) -> Shop:
        shop = build_shop(shop_url, mistakes)
        made.append(shop)
        return shop

    yield make
    for shop in made:
        shop.engine.dispose()
        shop.outside.dispose()


def build_shop(url: str, mistakes: Mistakes) -> Shop:
    outside = create_engine(url)  # the provider's, and a careless phase's, own connections
    provider = Provider(outside, dedupe=not mistakes.provider_ignores_keys)
    receipts = InProcessBackend()
    engine = rp.Engine(url, jobs=receipts)
    op: rp.Operation[Any] = rp.Operation("checkout")

    @op.atomic_phase("order_created")
    def create_order(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.state["order_id"] = tx.scalar(
            "INSERT INTO orders (key_id) VALUES (%s) RETURNING id", (tx.key_id,)
        )
        audit = "INSERT INTO order_audit (key_id) VALUES (:k)"
        if mistakes.second_connection:
            with outside.begin() as conn:  # commits whatever the phase's transaction does
                conn.execute(sa.text(audit), {"k": tx.key_id})
        else:
            tx.connection.execute(sa.text(audit), {"k": tx.key_id})

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        key = None if mistakes.no_downstream_key else step.downstream_key()
        if mistakes.provider_unreachable:
            raise ConnectionError("provider unreachable")
        if mistakes.step_skips_when_done and key is not None and provider.find(key):
            return {}  # "already charged": but the charge id then never reaches tx.state
        return {"charge_id": provider.charge(key, params["amount"])}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.execute(
            "UPDATE orders SET charge_id = %s WHERE id = %s",
            (tx.state["charge_id"], tx.state["order_id"]),
        )
        tx.stage_job("send_receipt", {"order_id": tx.state["order_id"]})
        return rp.Response(201, {"order_id": tx.state["order_id"]})

    @receipts.handler("send_receipt")
    def send_receipt(job: Job) -> None:
        with engine.db.begin() as conn:
            if mistakes.consumer_ignores_job_key or consume_once(conn, "send_receipt", job.job_key):
                conn.execute(sa.text("INSERT INTO receipts VALUES (:k)"), {"k": job.job_key})

    engine.register(op)
    return Shop(engine, op, outside)


def test_a_correct_operation_passes_every_schedule(make_shop: Any) -> None:
    seen: list[tuple[int, int]] = []
    found = make_shop().explore(depth=1, progress=lambda done, known: seen.append((done, known)))

    assert found.ok, found.report()
    assert found.by_depth[0] == 1
    # 7 boundaries (2 commits with their after_commits, 2 around the step, the publish),
    # each raised and died at, each recovered by the client and by the completer; and a
    # storm of serialization failures before each of the 2 commits, a lost answer and a
    # failover after each, and the engine's connections ended during the step and its
    # lease run out as it returned, each way.
    assert found.by_depth[1] == 7 * 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2 + 2 + 2
    assert seen[-1] == (found.schedules, found.schedules)


MISTAKES = {
    "no downstream key": (
        Mistakes(no_downstream_key=True),
        "client: attempt 1 raises at after_foreign:charged",
        "your check one_of_each",
        "never asked for step.downstream_key()",
    ),
    "provider ignores keys": (
        Mistakes(provider_ignores_keys=True),
        "client: attempt 1 raises at after_foreign:charged",
        "your check one_of_each",
        "the provider is where the guarantee ends",
    ),
    "write through a second connection": (
        Mistakes(second_connection=True),
        "client: attempt 1 raises at before_commit:order_created",
        "your check one_of_each",
        "2 audit rows for one order",
    ),
    "consumer ignores job_key": (
        Mistakes(consumer_ignores_job_key=True),
        "client: attempt 2 raises at after_publish:send_receipt",
        "each staged job is consumed once, through consume_once",
        "must run its work under consume_once",
    ),
    "step skips when done": (
        Mistakes(step_skips_when_done=True),
        "client: attempt 1 raises at after_foreign:charged",
        "the key finishes",
        "the key stopped at charged; last error: KeyError: 'charge_id'",
    ),
}


@pytest.mark.parametrize(
    ("mistakes", "schedule", "invariant", "said"), MISTAKES.values(), ids=MISTAKES
)
def test_each_mistake_is_found_with_its_smallest_schedule(
    make_shop: Any, mistakes: Mistakes, schedule: str, invariant: str, said: str
) -> None:
    found = make_shop(mistakes).explore()

    assert not found.ok
    smallest = found.failures[0]
    assert str(smallest.schedule) == schedule, found.report()
    assert smallest.invariant == invariant, found.report()
    assert said in found.report()
    # The provider is named only when what it did twice is what the check found.
    blamed = "the provider is where the guarantee ends" in found.report()
    assert blamed == (said == "the provider is where the guarantee ends"), found.report()
    assert f'reproduce: explore(..., schedule="{schedule}")' in found.report()
    # The reproduction runs that schedule alone, and fails the same way.
    again = make_shop(mistakes).explore(schedule=schedule)
    assert again.schedules == 1
    assert again.failures[0].invariant == invariant


def test_a_step_that_never_returns_is_not_blamed_on_the_provider(make_shop: Any) -> None:
    """Called every attempt, returning never: the key does not finish, with the step's
    error; no hint that the provider acted twice, since it never answered."""
    found = make_shop(Mistakes(provider_unreachable=True)).explore(depth=1)

    assert str(found.failures[0].schedule) == "client: no crash", found.report()
    assert found.failures[0].invariant == "the key finishes"
    assert "last error: ConnectionError: provider unreachable" in found.report()
    assert "provider is where the guarantee ends" not in found.report()
    assert "charges: 0 row(s)" in found.report()


def test_an_engine_that_does_not_answer_leaves_the_operation_as_it_was(make_shop: Any) -> None:
    shop = make_shop()
    phases = list(shop.operation.phases)
    level = logging.getLogger("recoverypoint").level
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    nobody = create_engine(f"postgresql://postgres@127.0.0.1:{port}/none")
    try:
        with pytest.raises(sa.exc.OperationalError):
            explore(shop.engine, shop.operation, {"amount": 2000}, tables=TABLES, dispose=[nobody])
    finally:
        nobody.dispose()
    assert shop.operation.phases == phases  # none left wrapped by the exploration
    assert type(shop.engine.jobs) is InProcessBackend
    assert logging.getLogger("recoverypoint").level == level
    assert shop.explore(depth=0).ok  # and it explores as before


def test_the_same_operation_gives_the_same_report(make_shop: Any) -> None:
    first = make_shop(Mistakes(provider_ignores_keys=True)).explore(depth=1)
    second = make_shop(Mistakes(provider_ignores_keys=True)).explore(depth=1)
    assert [str(f.schedule) for f in first.failures] == [str(f.schedule) for f in second.failures]
    assert first.schedules == second.schedules


points = st.from_regex(r"[a-z_]{1,12}:[a-z_*]{1,12}", fullmatch=True)
crashes = st.builds(
    Crash,
    attempt=st.integers(1, 9),
    point=points,
    nth=st.integers(1, 5),
    effect=st.sampled_from(
        ["raise", "exit", "lost_answer", "disconnect", "lease_lost", "failover"]
    ),
) | st.builds(
    Crash,
    attempt=st.integers(1, 9),
    point=points,
    nth=st.integers(1, 5),
    effect=st.just("conflict"),
    times=st.integers(1, 20),
)


@given(st.sampled_from(["client", "completer"]), st.lists(crashes, max_size=3))
def test_every_schedule_reads_back_as_written(recovery: Any, crashed: list[Crash]) -> None:
    schedule = Schedule(recovery, tuple(crashed))
    assert Schedule.parse(str(schedule)) == schedule


@given(st.text(max_size=80))
def test_any_text_is_a_schedule_or_a_clear_error(text: str) -> None:
    try:
        parsed = Schedule.parse(text)
    except ValueError as exc:
        assert "schedule begins with" in str(exc) or "not a crash" in str(exc)
    else:
        assert Schedule.parse(str(parsed)) == parsed


def test_schedules_read_back() -> None:
    text = "completer: attempt 1 dies at after_foreign:charged; attempt 2 raises at x:y (hit 2)"
    assert str(Schedule.parse(text)) == text
    with pytest.raises(ValueError, match="begins with"):
        Schedule.parse("attempt 1 raises at x:y")
    with pytest.raises(ValueError, match="not a crash"):
        Schedule.parse("client: crash somewhere")
    with pytest.raises(ValueError, match="not a crash"):
        Schedule.parse("client: attempt 1 raises at x:y (hit 0)")


def test_rocket_rides_passes_every_schedule_to_depth_two(server_url: str) -> None:
    # As the command, in a process of its own: forked from a test worker, whose heap holds
    # every module of the suite, each of its 900 attempts' processes costs a third more.
    ran = explore_command(
        server_url, "recoverypoint.demo.rocket_rides.explore:subject", "--depth", "2", "--json"
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    found = json.loads(ran.stdout)
    print({key: found[key] for key in ("schedules", "by_depth", "seconds")})
    assert found["ok"], found["failures"]
    # Its charge declares its provider's window and no hook: the 2 crashes around it are
    # tried with recovery past the window too (and again with the recovery dying before
    # the charge, the one boundary it reaches), each leaving the key for an operator. Its
    # 2 atomic phases meet a storm of serialization failures each and lose the answer to
    # their commits and the commits to a failover, and its charge loses its connections
    # and its lease, each way.
    assert found["by_depth"]["1"] == 7 * 2 * 2 + 2 * 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2 + 2 + 2
    outcomes = found["past_window"].values()
    held = sum(outcome == "needs reconciliation" for outcome in outcomes)
    assert held == len(outcomes) == 2 * 2 * 2 * (1 + 2)
    assert found["schedules"] > 200


def shop_ignoring_keys(database_url: str) -> Subject:
    """For the command line: the shop whose provider does not dedupe."""
    db = create_engine(database_url, poolclass=NullPool)
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    shop = build_shop(database_url, Mistakes(provider_ignores_keys=True))
    return Subject(
        shop.engine,
        shop.operation,
        {"amount": 2000},
        check=one_of_each,
        tables=TABLES,
        dispose=[shop.outside],
    )


def explore_command(server_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", "explore", *args, "--database-url", server_url],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )


def test_the_command_passes_rocket_rides(server_url: str) -> None:
    ran = explore_command(
        server_url, "recoverypoint.demo.rocket_rides.explore:subject", "--depth", "1"
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "crashes  schedules  broke an invariant" in ran.stdout
    assert "create_ride: every invariant held in 53 schedules (depth 1)" in ran.stdout
    assert "8 left the key in the state needs-reconciliation" in ran.stdout
    assert "explore: 53/53 schedules" in ran.stderr


def test_the_command_reports_the_smallest_failing_schedule(server_url: str) -> None:
    ran = explore_command(server_url, "test_explore:shop_ignoring_keys")

    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert (
        "smallest failing schedule: client: attempt 1 raises at after_foreign:charged" in ran.stdout
    )
    assert "the provider is where the guarantee ends" in ran.stdout
    assert "charges: 2 row(s)" in ran.stdout
    assert (
        "run it alone: recoverypoint explore test_explore:shop_ignoring_keys --schedule "
        '"client: attempt 1 raises at after_foreign:charged"'
    ) in ran.stdout


def test_the_command_refuses_what_is_not_a_subject(server_url: str) -> None:
    ran = explore_command(server_url, "test_explore:TABLES")
    assert ran.returncode == 2
    assert "test_explore:TABLES is not a function of a database URL" in ran.stderr
    ran = explore_command(server_url, "no_such_module:subject")
    assert ran.returncode == 2
    assert "cannot load no_such_module:subject" in ran.stderr
    ran = explore_command(
        server_url, "recoverypoint.demo.rocket_rides.explore:subject", "--schedule", "soon"
    )
    assert ran.returncode == 2
    assert "a schedule begins with 'client:' or 'completer:'" in ran.stderr
    assert "Traceback" not in ran.stderr


PLUGIN_TEST = """
import os

from recoverypoint import migrate
from recoverypoint.testing import temporary_database
from test_explore import shop_ignoring_keys


def test_checkout_is_crash_safe(explore_crashes):
    with temporary_database(os.environ["EXPLORE_SERVER_URL"]) as url:
        migrate.upgrade(url)
        explore_crashes(shop_ignoring_keys(url), depth=1)
"""


def test_the_pytest_fixture_fails_with_the_report(server_url: str, tmp_path: Path) -> None:
    (tmp_path / "test_shop.py").write_text(PLUGIN_TEST)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent),
        "EXPLORE_SERVER_URL": server_url,
    }
    # test_explore, which the file imports for its shop, carries the suite's `slow` mark,
    # which this pytest (no pyproject.toml) does not know.
    quiet = ["-W", "ignore::pytest.PytestUnknownMarkWarning"]
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *quiet, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=tmp_path,
    )

    assert ran.returncode == 1, ran.stdout + ran.stderr
    out = ran.stdout
    assert "Failed: checkout: " in out
    assert "smallest failing schedule: client: attempt 1 raises at after_foreign:charged" in out
    assert 'reproduce: explore(..., schedule="client: attempt 1' in out
    assert "explore.py:" not in out  # the report, not a traceback through explore


@pytest.mark.parametrize("asks_for_the_key", [True, False])
def test_an_idempotent_function(shop_url: str, asks_for_the_key: bool) -> None:
    """Called again by its client alone (only the caller has its arguments): with
    rp.downstream_key() it holds everywhere; without, the provider charges again."""
    outside = create_engine(shop_url)
    provider = Provider(outside, dedupe=True)
    engine = rp.Engine(shop_url)

    @rp.idempotent(engine, key="order_id", name="pay")
    def pay(order_id: int, amount: int) -> int:
        return provider.charge(rp.downstream_key() if asks_for_the_key else None, amount)

    def one_charge(conn: sa.Connection) -> None:
        charges = conn.scalar(sa.text("SELECT count(*) FROM charges"))
        assert charges == 1, f"{charges} charges for one payment"

    try:
        found = explore(
            engine,
            pay,
            {"order_id": 7, "amount": 2000},
            check=one_charge,
            tables=["charges"],
            dispose=[outside],
        )
    finally:
        engine.dispose()
        outside.dispose()

    if asks_for_the_key:
        assert found.ok, found.report()
        # The step's two boundaries and the commit's two; a storm before the commit, a lost
        # answer and a failover after it, the connections ended during the step, its lease
        # run out.
        assert found.by_depth[1] == 4 * 2 + 1 + 1 + 1 + 1 + 1
    else:
        assert str(found.failures[0].schedule) == "client: attempt 1 raises at after_foreign:called"
        assert "never asked for step.downstream_key()" in found.report()


def test_a_process_that_dies_leaves_what_a_sigkill_would(make_shop: Any) -> None:
    """The attempt runs in a forked process that dies after the charge: no rollback, the
    lease held (the retry waits it out), and what the step did reaches the report."""
    schedule = "client: attempt 1 dies at after_foreign:charged"
    found = make_shop(Mistakes(provider_ignores_keys=True)).explore(schedule=schedule)

    failure = found.failures[0]
    assert failure.story[0] == "1. client    died at after_foreign:charged"
    assert failure.story[1].startswith("2. client    answered 201")
    assert "ran 2 times with the same downstream key" in found.report()  # one call was the child's
    # Two deaths, then the completer: each call counted once, wherever it ran.
    twice = (
        "completer: attempt 1 dies at after_foreign:charged; "
        "attempt 2 dies at after_foreign:charged"
    )
    found = make_shop(Mistakes(provider_ignores_keys=True)).explore(schedule=twice)
    assert "AssertionError: 3 charges for one order" in found.report()
    assert "ran 3 times with the same downstream key" in found.report(), found.report()


def test_max_schedules_samples_the_deeper_schedules(make_shop: Any) -> None:
    """Every schedule of one crash first (45), then a seeded sample of those of two."""
    found = make_shop().explore(depth=2, max_schedules=46, seed=1)
    assert found.ok, found.report()
    assert dict(found.by_depth) == {0: 1, 1: 44, 2: 1}


@pytest.mark.parametrize("passes_the_key_on", [True, False])
def test_a_single_step_endpoint(shop_url: str, passes_the_key_on: bool) -> None:
    """A Flask view made single-step, explored through Flask's test client (its view runs
    only inside a request), recovered by its client alone: passing the request's key on to
    a provider that dedupes holds everywhere; without, the retry charges again."""
    flask = pytest.importorskip("flask")
    from recoverypoint.integrations.flask import Idempotency

    outside = create_engine(shop_url)
    provider = Provider(outside, dedupe=True)
    engine = rp.Engine(shop_url)
    app = flask.Flask("shop")
    app.testing = True  # an exception the view did not handle reaches the test client
    idempotency = Idempotency(engine, scope=lambda request: "alice")

    @app.post("/pay")
    @idempotency.single_step("pay_view")
    def pay_view() -> tuple[dict[str, int], int]:
        key = flask.request.headers["Idempotency-Key"] if passes_the_key_on else None
        return {"charge_id": provider.charge(key, 2000)}, 201

    client = app.test_client()

    def request() -> tuple[int, Any]:
        got = client.post("/pay", json={"amount": 2000}, headers={"Idempotency-Key": "k1"})
        # An outage, or a lease lost to a takeover (409): its client retries with the key.
        if got.status_code >= 500 or got.status_code == 409:
            raise RuntimeError(f"answered {got.status_code}: {got.get_data(as_text=True)}")
        return got.status_code, got.get_json()

    def one_charge(conn: sa.Connection) -> None:
        charges = conn.scalar(sa.text("SELECT count(*) FROM charges"))
        assert charges == 1, f"{charges} charges for one payment"

    try:
        found = explore(
            engine,
            engine.operation("pay_view", 1),
            request=request,
            check=one_charge,
            tables=["charges"],
            dispose=[outside],
        )
        with pytest.raises(TypeError, match="pass request="):
            explore(engine, engine.operation("pay_view", 1), {})
    finally:
        engine.dispose()
        outside.dispose()

    if passes_the_key_on:
        assert found.ok, found.report()
        # The view's two boundaries and the commit's two; a storm before the commit, a lost
        # answer and a failover after it, the connections ended during the view, its lease
        # run out.
        assert found.by_depth[1] == 4 * 2 + 1 + 1 + 1 + 1 + 1
        assert found.schedules > found.by_depth[1] + 1  # and crashes in the retry too
    else:
        assert str(found.failures[0].schedule) == (
            "client: attempt 1 raises at after_foreign:responded"
        ), found.report()
        assert "AssertionError: 2 charges for one payment" in found.report()
        assert "the endpoint ran 2 times" in found.report()
        assert "never asked for step.downstream_key()" not in found.report()
