"""Compensations on real PostgreSQL: an abandoned key's operation undoes its committed
phases once, fenced, whoever abandoned the key; without one, the key says its effects stay.

A payment operation charges in its first phase (a ``charges`` row) and fails in its last,
always: its key is abandoned, by the completer after ``max_attempts`` or by an operator.
Its compensation writes a ``refunds`` row and stages a refund email. Both engines.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from workload import rows

import recoverypoint as rp
from recoverypoint import admin, testing
from recoverypoint.cli import main
from recoverypoint.exits import EXIT_OK
from recoverypoint.workers import ABANDONED_RESPONSE, Completer, CompleterResult, Reaper, loop

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (key_id bigint PRIMARY KEY);
CREATE TABLE IF NOT EXISTS refunds (key_id bigint NOT NULL, point text NOT NULL,
                                    charged bigint NOT NULL);
"""

Kind = str  # "sync" or "async"


class Payments:
    """A payment operation for ``kind``'s engine, its compensation failing ``fail`` times."""

    def __init__(self, db: sa.Engine, kind: Kind, *, compensate: bool = True, fail: int = 0):
        self.kind = kind
        self.fail = fail
        self.ran = 0
        with db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        op: rp.Operation[Any] = rp.Operation("payment", max_attempts=1)
        self.operation = op

        def charge(tx: Any, params: Any) -> None:
            tx.state["charged"] = tx.key_id
            return None

        def compensation(tx: Any, params: Any) -> None:
            self.ran += 1
            if self.fail:
                self.fail -= 1
                raise RuntimeError("the payment provider is down")
            tx.stage_job("refund_email", {"key_id": tx.key_id})
            return None

        if kind == "sync":

            @op.atomic_phase("charged")
            def charged(tx: rp.AtomicContext, params: Any) -> None:
                tx.execute("INSERT INTO charges VALUES (%s)", (tx.key_id,))
                charge(tx, params)

            @op.atomic_phase("finished")
            def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
                raise rp.Retryable("the ledger is down")

            if compensate:

                @op.compensation
                def refund(tx: rp.AtomicContext, params: Any) -> None:
                    compensation(tx, params)
                    tx.execute(
                        "INSERT INTO refunds VALUES (%s, %s, %s)",
                        (tx.key_id, tx.recovery_point, tx.state["charged"]),
                    )

        else:

            @op.atomic_phase("charged")
            async def acharged(tx: rp.AsyncAtomicContext, params: Any) -> None:
                await tx.execute("INSERT INTO charges VALUES (%s)", (tx.key_id,))
                charge(tx, params)

            @op.atomic_phase("finished")
            async def afinish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
                raise rp.Retryable("the ledger is down")

            if compensate:

                @op.compensation
                async def arefund(tx: rp.AsyncAtomicContext, params: Any) -> None:
                    compensation(tx, params)
                    await tx.execute(
                        "INSERT INTO refunds VALUES (%s, %s, %s)",
                        (tx.key_id, tx.recovery_point, tx.state["charged"]),
                    )

        self.db = db
        self.engines: list[rp.Engine | rp.AsyncEngine] = []
        self.completers: list[Completer] = []
        self.engine = self.new_engine()

    def new_engine(self) -> rp.Engine | rp.AsyncEngine:
        """An engine of the application, as each process of it has its own."""
        engine: rp.Engine | rp.AsyncEngine
        if self.kind == "sync":
            engine = rp.Engine(self.db.url.render_as_string(hide_password=False))
        else:
            engine = rp.AsyncEngine(self.db.url.render_as_string(hide_password=False))
        engine.register(self.operation)
        self.engines.append(engine)
        return engine

    def call(self, key: str) -> Any:
        """A client's request with ``key``: what the engine answered."""
        if isinstance(self.engine, rp.AsyncEngine):
            engine = self.engine

            async def call() -> Any:  # as a client, on a loop of its own
                try:
                    return await engine.run(self.operation, key=key, params={}, scope="s")
                finally:
                    await engine.dispose()

            return asyncio.run(call())
        return self.engine.run(self.operation, key=key, params={}, scope="s")

    def request(self, key: str = "k") -> int:
        """A client's request that charges, then fails: its key's id."""
        with pytest.raises(rp.Retryable):
            self.call(key)
        [row] = rows(
            self.engine.db, "SELECT id FROM idempotency_keys WHERE idempotency_key = :k", k=key
        )
        # Due for the completer now, not after its backoff.
        with self.engine.db.begin() as conn:
            conn.execute(sa.text("UPDATE idempotency_keys SET next_attempt_at = now()"))
        return int(row.id)

    def completer(self) -> Completer:
        """A completer in a process of its own: with an engine of its own."""
        self.completers.append(Completer(self.new_engine(), min_age=0))
        return self.completers[-1]

    def close(self) -> None:
        for completer in self.completers:
            completer.close()
        for engine in self.engines:
            if isinstance(engine, rp.AsyncEngine):
                asyncio.run(engine.dispose())
            else:
                engine.dispose()


@pytest.fixture(params=["sync", "async"])
def payments(request: pytest.FixtureRequest, worker_db: sa.Engine) -> Callable[..., Payments]:
    made: list[Payments] = []

    def make(**options: Any) -> Payments:
        made.append(Payments(worker_db, request.param, **options))
        return made[-1]

    yield make  # type: ignore[misc]
    for p in made:
        p.close()


def key_row(db: sa.Engine, key_id: int) -> Any:
    return rows(db, "SELECT * FROM idempotency_keys WHERE id = :i", i=key_id)[0]


def counts(db: sa.Engine) -> tuple[int, int, int]:
    """Charges, refunds and refund emails staged."""
    [row] = rows(
        db,
        """SELECT (SELECT count(*) FROM charges) AS charges, (SELECT count(*) FROM refunds)
           AS refunds, (SELECT count(*) FROM staged_jobs WHERE job_name = 'refund_email')
           AS emails""",
    )
    return row.charges, row.refunds, row.emails


def passes_at_once(completers: list[Completer]) -> CompleterResult:
    """One pass of each completer, all started together; their results added up."""
    barrier = threading.Barrier(len(completers))
    results: list[CompleterResult] = []

    def run(completer: Completer) -> None:
        barrier.wait()
        results.append(completer.run_once())

    threads = [threading.Thread(target=run, args=(c,)) for c in completers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = CompleterResult()
    for result in results:
        total.add(result)
    return total


def test_the_completer_abandons_a_key_and_compensates_it_once(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments()
    key_id = p.request()
    assert counts(worker_db) == (1, 0, 0)

    total = passes_at_once([p.completer(), p.completer()])

    assert (total.abandoned, total.compensated, total.compensation_failed) == (1, 1, 0)
    assert counts(worker_db) == (1, 1, 1)
    [refund] = rows(worker_db, "SELECT * FROM refunds")
    # It saw the key's state and the last point it committed.
    assert (refund.key_id, refund.point, refund.charged) == (key_id, "charged", key_id)
    row = key_row(worker_db, key_id)
    assert row.compensated_at is not None and row.lock_token is None
    assert (row.response_status, row.response_body) == (500, ABANDONED_RESPONSE.body)
    # Later passes, two at once again, leave it alone.
    again = passes_at_once([p.completer(), p.completer()])
    assert (again.abandoned, again.compensated) == (0, 0)
    assert counts(worker_db) == (1, 1, 1)


def test_an_operators_abandon_is_compensated_by_the_next_pass(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments()
    p.operation.max_attempts = 5  # the completer would not give it up yet
    key_id = p.request()
    # The operator's tool does not load the application: it knows no operation.
    admin.abandon(admin.Admin(worker_db), key_id, message="given up by hand")
    body = key_row(worker_db, key_id).response_body

    total = passes_at_once([p.completer(), p.completer()])

    assert (total.abandoned, total.finished, total.compensated) == (0, 0, 1)
    assert counts(worker_db) == (1, 1, 1)
    row = key_row(worker_db, key_id)
    assert row.compensated_at is not None and row.response_body == body
    shown = admin.find_key(admin.Admin(worker_db, operations=(p.operation,)), key_id)
    assert shown.compensation == f"compensated at {row.compensated_at:%Y-%m-%d %H:%M:%S}"


def test_a_pass_compensates_at_most_its_most_batches_and_the_next_goes_on(
    payments: Callable[..., Payments], worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Abandoned keys awaiting a compensation cannot keep one pass running either: it ends
    after its most full batches, and the next pass goes on."""
    monkeypatch.setattr(loop, "BATCHES_PER_PASS", 2)
    p = payments()
    p.operation.max_attempts = 5  # the completer would not give them up yet
    ids = [p.request(f"k{n}") for n in range(3)]
    for key_id in ids:
        admin.abandon(admin.Admin(worker_db), key_id, message="given up by hand")
    completer = Completer(p.new_engine(), min_age=0, batch_size=1)
    p.completers.append(completer)

    assert [completer.run_once().compensated for _ in range(3)] == [2, 1, 0]
    assert counts(worker_db) == (3, 3, 3)


@pytest.mark.slow
def test_a_failed_compensation_is_counted_and_tried_again_later(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments(fail=1)
    key_id = p.request()

    first = p.completer().run_once()
    assert (first.abandoned, first.compensated, first.compensation_failed) == (1, 0, 1)
    assert counts(worker_db) == (1, 0, 0)  # rolled back: nothing staged either
    row = key_row(worker_db, key_id)
    assert row.compensated_at is None and row.lock_token is None
    assert row.last_error == "compensation failed: RuntimeError: the payment provider is down"
    assert row.compensation_attempts == 1 and row.compensation_due_at is not None
    shown = admin.find_key(admin.Admin(worker_db, operations=(p.operation,)), key_id)
    assert shown.compensation is not None and "failing (failed tries: 1)" in shown.compensation
    [check] = [c for c in admin.diagnose(admin.Admin(worker_db)) if c.name == "compensations"]
    assert check.status == "warn" and "1 abandoned" in check.detail

    # Backed off: the next pass does not try it.
    assert p.completer().run_once().compensation_failed == 0 and p.ran == 1
    testing.Clock(worker_db).advance(seconds=p.engine.retry_base)  # its back-off waited out
    later = p.completer().run_once()
    assert (later.compensated, later.compensation_failed) == (1, 0)
    assert counts(worker_db) == (1, 1, 1)
    row = key_row(worker_db, key_id)
    assert row.compensated_at is not None and row.compensation_due_at is None
    # The abandoned response is the one the completer stored.
    assert row.response_body == ABANDONED_RESPONSE.body
    [check] = [c for c in admin.diagnose(admin.Admin(worker_db)) if c.name == "compensations"]
    assert check.status == "ok"


def test_without_a_compensation_the_key_is_left_alone_and_says_its_effects_stay(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments(compensate=False)
    key_id = p.request()
    assert p.completer().run_once().abandoned == 1
    before = key_row(worker_db, key_id)

    result = p.completer().run_once()

    assert (result.compensated, result.compensation_failed) == (0, 0)
    assert key_row(worker_db, key_id) == before
    assert counts(worker_db) == (1, 0, 0)
    for known in ((), (p.operation,)):
        shown = admin.find_key(admin.Admin(worker_db, operations=known), key_id)
        assert shown.compensation is not None
        assert "the effects of phases up to 'charged' stay" in shown.compensation


def test_a_key_abandoned_before_compensations_existed_is_never_touched(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments()
    p.operation.max_attempts = 5
    key_id = p.request()
    # As the abandonment of an earlier release left it: no compensation due.
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                """UPDATE idempotency_keys SET finished_at = now(), abandoned_at = now(),
                   response_status = 500, response_body = '{}' WHERE id = :i"""
            ),
            {"i": key_id},
        )

    assert p.completer().run_once().compensated == 0
    assert counts(worker_db) == (1, 0, 0)
    assert key_row(worker_db, key_id).compensated_at is None


@pytest.mark.slow
def test_only_compensation_due_at_says_whether_an_abandoned_key_is_compensated(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments()
    p.operation.max_attempts = 5
    due, old = p.request("due"), p.request("old")
    admin.abandon(admin.Admin(worker_db), due)
    with worker_db.begin() as conn:  # "old" as an earlier release abandoned it
        conn.execute(
            sa.text(
                """UPDATE idempotency_keys SET finished_at = now(), abandoned_at = now(),
                   response_status = 500, response_body = '{}' WHERE id = :i"""
            ),
            {"i": old},
        )
    # Later writes to both keys' other columns, as any tool or operator's action may make:
    # they decide nothing.
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                """UPDATE idempotency_keys SET last_error = 'looked at by hand',
                   next_attempt_at = now() - interval '1 hour' WHERE id = :i"""
            ),
            {"i": due},
        )
        conn.execute(
            sa.text(
                """UPDATE idempotency_keys SET next_attempt_at = abandoned_at,
                   last_error = 'compensation failed: by an earlier tool' WHERE id = :i"""
            ),
            {"i": old},
        )
    [check] = [c for c in admin.diagnose(admin.Admin(worker_db)) if c.name == "compensations"]
    assert check.status == "ok"

    result = p.completer().run_once()

    assert (result.compensated, result.compensation_failed) == (1, 0)
    assert [r.key_id for r in rows(worker_db, "SELECT key_id FROM refunds")] == [due]
    assert key_row(worker_db, old).compensated_at is None
    shown = admin.find_key(admin.Admin(worker_db, operations=(p.operation,)), old).compensation
    assert shown is not None and shown.startswith("not compensated")


def test_an_abandonment_by_a_clients_claim_is_compensated(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments()  # one attempt, used by the first request
    key_id = p.request()

    answer = p.call("k")  # the retry's claim abandons the key instead of a second attempt

    assert (answer.status, answer.body) == (ABANDONED_RESPONSE.status, ABANDONED_RESPONSE.body)
    result = p.completer().run_once()
    assert (result.abandoned, result.compensated) == (0, 1)
    assert counts(worker_db) == (1, 1, 1)
    assert key_row(worker_db, key_id).compensated_at is not None  # the request's own key


def test_a_reopened_key_awaits_no_compensation_and_one_compensated_never_reopens(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments(fail=1)
    p.operation.max_attempts = 5
    key_id = p.request()
    db = admin.Admin(worker_db)
    admin.abandon(db, key_id)
    assert p.completer().run_once().compensation_failed == 1

    admin.reopen(db, key_id)
    row = key_row(worker_db, key_id)
    assert (row.compensation_due_at, row.compensation_attempts) == (None, 0)
    admin.abandon(db, key_id)
    assert p.completer().run_once().compensated == 1

    # Reopened, it would run the rest of its phases on top of the undo (a charge after
    # the refund): refused, and nothing changes.
    with pytest.raises(admin.Refused, match="was compensated at"):
        admin.reopen(db, key_id)
    assert key_row(worker_db, key_id).abandoned_at is not None
    assert p.completer().run_once().compensated == 0
    assert counts(worker_db) == (1, 1, 1)


def test_a_compensation_is_declared_once_and_of_the_engines_kind() -> None:
    op: rp.Operation[Any] = rp.Operation("op")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> None:
        return None

    @op.compensation
    def undo(tx: rp.AtomicContext, params: Any) -> None:
        return None

    with pytest.raises(rp.DeclarationError, match="declared twice"):
        op.compensation(undo)
    with pytest.raises(rp.DeclarationError, match="plain function"):
        rp.AsyncEngine("postgresql://nowhere/db").register(op)

    named: rp.Operation[Any] = rp.Operation("named")

    @named.atomic_phase("compensated")
    def compensated(tx: rp.AtomicContext, params: Any) -> None:
        return None

    named.compensation(undo)
    with pytest.raises(rp.DeclarationError, match="names the compensation"):
        named.validate()


def test_the_cli_says_what_stays_and_what_was_compensated(
    payments: Callable[..., Payments],
    worker_db: sa.Engine,
    worker_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", worker_database_url)
    p = payments(compensate=False)
    p.operation.max_attempts = 5
    key_id = p.request()

    assert main(["keys", "abandon", str(key_id)]) == EXIT_OK
    said = capsys.readouterr().out
    assert f"abandoned key {key_id}: retries now replay a 500" in said
    assert "What its committed phases did stays" in said

    # Without the application, and without compensation, the key says its effects stay.
    assert main(["keys", "show", str(key_id)]) == EXIT_OK
    shown = capsys.readouterr().out
    assert "abandoned, compensation pending if its operation declares one" in shown
    assert p.completer().run_once().compensated == 0
    monkeypatch.setattr(sys.modules[__name__], "application", p.engine, raising=False)
    assert main(["keys", "show", str(key_id), "--app", f"{__name__}:application"]) == EXIT_OK
    shown = capsys.readouterr().out
    assert (
        "abandoned, not compensated: the effects of phases up to 'charged' stay, for a human "
        "to undo" in shown
    )
    assert main(["keys", "list", "--app", f"{__name__}:application"]) == EXIT_OK
    assert "abandoned, not compensated" in capsys.readouterr().out


def test_keys_list_shows_a_compensation_pending_then_done(
    payments: Callable[..., Payments],
    worker_db: sa.Engine,
    worker_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", worker_database_url)
    p = payments()
    p.operation.max_attempts = 5
    key_id = p.request()
    admin.abandon(admin.Admin(worker_db), key_id)
    monkeypatch.setattr(sys.modules[__name__], "application", p.engine, raising=False)
    app = f"{__name__}:application"

    assert main(["keys", "list", "--app", app]) == EXIT_OK
    assert "abandoned, compensation pending" in capsys.readouterr().out
    assert p.completer().run_once().compensated == 1
    assert main(["keys", "list", "--app", app]) == EXIT_OK
    assert "abandoned, compensated" in capsys.readouterr().out


def test_the_reaper_keeps_an_abandoned_key_until_its_compensation_ran(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments(fail=1)
    key_id = p.request()
    assert p.completer().run_once().compensation_failed == 1
    testing.Clock(worker_db).advance(days=31)  # past the abandoned keys' retention
    reaper = Reaper(p.engine)
    assert reaper.run_once().abandoned == 0  # its compensation is still to run
    assert key_row(worker_db, key_id).compensated_at is None
    assert p.completer().run_once().compensated == 1
    assert reaper.run_once().abandoned == 1
    assert counts(worker_db) == (1, 1, 1)
    assert rows(worker_db, "SELECT id FROM idempotency_keys WHERE id = :k", k=key_id) == []


def test_the_reaper_deletes_an_abandoned_key_with_no_compensation_to_run(
    payments: Callable[..., Payments], worker_db: sa.Engine
) -> None:
    p = payments(compensate=False)
    p.request()
    assert p.completer().run_once().abandoned == 1
    testing.Clock(worker_db).advance(days=31)
    assert Reaper(p.engine).run_once().abandoned == 1
