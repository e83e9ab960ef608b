""" "Exactly once" at the edges of the engine: hostile input, database timeouts, declarations
PostgreSQL cannot store, fingerprints across processes and deploys, leases after slow
phases, phase code that ends the engine's transaction, and replays equal to first answers.

Each test here failed on the engine before the fix it covers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from rides import count

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.keys import MAX_JSON_DEPTH


def keys_in(db: sa.Engine, scope: str) -> int:
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope)


def key_row(db: sa.Engine, scope: str) -> dict[str, Any]:
    with db.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        ).one()
    return dict(row._mapping)


def one_phase(name: str, ran: list[Any], **options: Any) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name, **options)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append(params)
        return rp.Response(201, {"ok": True})

    return op


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# -- 1. bad input is a 4xx and stores nothing ------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{"name": "\ud800"}, {"\udfff": 1}, ["ok", "\ud83d"]],
    ids=["value", "key", "array"],
)
@pytest.mark.slow
def test_lone_surrogates_in_params_are_invalid_params(
    engine: rp.Engine, db: sa.Engine, scope: str, params: Any
) -> None:
    ran: list[Any] = []
    op = one_phase("surrogates", ran)
    engine.register(op)
    with pytest.raises(rp.InvalidParams, match="surrogate"):
        engine.run(op, key="k", params=params, scope=scope)
    assert keys_in(db, scope) == 0 and ran == []


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/accounts/\x00/charges", rp.InvalidParams),
        ("/accounts/\ud800", rp.InvalidParams),
        ("/" + "a" * 9000, rp.RequestTooLarge),
    ],
    ids=["nul", "surrogate", "too-long"],
)
@pytest.mark.slow
def test_a_path_that_cannot_be_stored_is_refused_before_the_claim(
    engine: rp.Engine, db: sa.Engine, scope: str, path: str, error: type[Exception]
) -> None:
    ran: list[Any] = []
    op = one_phase("paths", ran)
    engine.register(op)
    with pytest.raises(error):
        engine.run(op, key="k", params={}, scope=scope, request=rp.Request("POST", path))
    assert keys_in(db, scope) == 0 and ran == []


@pytest.mark.parametrize("method", ["", "PO ST", "GET\x00", "X" * 40])
def test_a_method_that_is_not_a_token_is_refused(
    engine: rp.Engine, db: sa.Engine, scope: str, method: str
) -> None:
    ran: list[Any] = []
    op = one_phase("methods", ran)
    engine.register(op)
    with pytest.raises(rp.InvalidParams, match="method"):
        engine.run(op, key="k", params={}, scope=scope, request=rp.Request(method, "/x"))
    assert keys_in(db, scope) == 0


class Anything(BaseModel):
    data: Any


@pytest.mark.parametrize("typed", [False, True], ids=["json", "pydantic"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000])
def test_json_nested_too_deep_is_invalid_params_with_the_limit_named(
    engine: rp.Engine, db: sa.Engine, scope: str, typed: bool, depth: int
) -> None:
    ran: list[Any] = []
    op = one_phase(f"deep_{typed}", ran, params=Anything if typed else None)
    engine.register(op)
    params = {"data": nested(depth)}
    with pytest.raises(rp.InvalidParams, match=f"deeper than {MAX_JSON_DEPTH}"):
        engine.run(op, key="k", params=params, scope=scope)
    assert keys_in(db, scope) == 0 and ran == []


def test_json_at_the_depth_limit_is_accepted(engine: rp.Engine, scope: str) -> None:
    ran: list[Any] = []
    op = one_phase("deep_ok", ran)
    engine.register(op)
    params = nested(MAX_JSON_DEPTH - 1)  # the outer list counts as a level
    assert engine.run(op, key="k", params=params, scope=scope).status == 201
    assert ran == [params]


# -- 2. a duplicate that meets a database timeout is a 409 -----------------------------------


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
def test_a_duplicate_cut_short_by_a_database_timeout_is_key_in_use(
    database_url: str, business_tables: None, scope: str, setting: str
) -> None:
    # As `ALTER ROLE app SET lock_timeout = '300ms'` would set it for every session.
    db = create_engine(database_url, connect_args={"options": f"-c {setting}=300ms"})
    engine = rp.Engine(db)
    entered, leave = threading.Event(), threading.Event()
    ran: list[str] = []
    op: rp.Operation[Any] = rp.Operation("slow_first_phase")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append("finish")
        entered.set()
        assert leave.wait(10)
        return rp.Response(201, {"ok": True})

    engine.register(op)
    first: list[rp.Outcome] = []
    thread = threading.Thread(
        target=lambda: first.append(engine.run(op, key="k", params={}, scope=scope))
    )
    thread.start()
    try:
        try:
            assert entered.wait(10)
            # The duplicate waits on the key's unique-index entry until the timeout fires.
            with pytest.raises(rp.KeyInUse) as caught:
                engine.run(op, key="k", params={}, scope=scope)
        finally:
            leave.set()
            thread.join()
        assert first[0].status == 201
        assert engine.run(op, key="k", params={}, scope=scope).replayed
    finally:
        db.dispose()
    assert caught.value.http_status == 409 and caught.value.retry_after >= 1
    assert ran == ["finish"]


# -- 3. a declaration PostgreSQL cannot store is a declaration error -------------------------


@pytest.mark.parametrize("name", ["pay\x00ment", "pay\nment", "pay\ud800", "\x7f"])
def test_operation_names_that_cannot_be_stored_are_refused(name: str) -> None:
    with pytest.raises(rp.DeclarationError, match="printable"):
        rp.Operation(name)


@pytest.mark.parametrize("point", ["char\x00ged", "char\tged", "\udc80"])
def test_recovery_points_that_cannot_be_stored_are_refused(point: str) -> None:
    op: rp.Operation[Any] = rp.Operation("points")
    with pytest.raises(rp.DeclarationError, match="printable"):
        op.atomic_phase(point)


def test_names_in_any_script_are_fine(engine: rp.Engine, scope: str) -> None:
    ran: list[Any] = []
    op = one_phase("créer_réservation_予約", ran)
    engine.register(op)
    assert engine.run(op, key="k", params={}, scope=scope).status == 201


# -- 4. the fingerprint is the same in every process ------------------------------------------

_SET_PARAMS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pydantic import BaseModel
    import recoverypoint as rp

    class Order(BaseModel):
        tags: set[str]
        skus: frozenset[int]

    engine = rp.Engine(sys.argv[1])
    op = rp.Operation("tagged_order", params=Order)
    runs = []

    @op.atomic_phase("finished")
    def finish(tx, params):
        runs.append(1)
        return rp.Response(201, {"tags": sorted(params.tags)})

    engine.register(op)
    params = {"tags": [f"tag-{n}" for n in range(20)], "skus": list(range(40, 0, -3))}
    try:
        outcome = engine.run(op, key="order-1", params=params, scope=sys.argv[2])
        answer = {"status": outcome.status, "replayed": outcome.replayed, "runs": len(runs)}
        print(json.dumps(answer))
    except rp.IdempotencyError as exc:
        print(json.dumps({"error": type(exc).__name__}))
    finally:
        engine.dispose()
    """
)


@pytest.mark.slow
def test_set_params_fingerprint_alike_under_different_hash_seeds(
    database_url: str, scope: str, tmp_path: Path
) -> None:
    script = tmp_path / "set_params.py"
    script.write_text(_SET_PARAMS_SCRIPT)
    answers = []
    for seed in ("1", "2", "3"):
        done = subprocess.run(
            [sys.executable, str(script), database_url, scope],
            env={**_environ(), "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout))
    assert answers == [
        {"status": 201, "replayed": False, "runs": 1},
        {"status": 201, "replayed": True, "runs": 0},
        {"status": 201, "replayed": True, "runs": 0},
    ]


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_set_params_dump_sorted(engine: rp.Engine) -> None:
    class Tagged(BaseModel):
        tags: set[str]
        nested: dict[str, frozenset[int]]

    op: rp.Operation[Any] = rp.Operation("sets", params=Tagged)
    dumped = op.dump_params({"tags": {"b", "c", "a"}, "nested": {"x": {3, 1, 2}}})
    assert dumped == '{"nested":{"x":[1,2,3]},"tags":["a","b","c"]}'


# -- 5. a key is judged by the version that started it ----------------------------------------


class RideV1(BaseModel):
    origin: str


class RideV2(BaseModel):
    origin: str
    tip_cents: int = 0  # added by the deploy, with a default


def versioned(version: int, ran: list[str], *, lock_timeout: float = 90.0) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(
        "deployed_ride",
        version=version,
        params=RideV1 if version == 1 else RideV2,
        lock_timeout=timedelta(seconds=lock_timeout),
    )

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        ran.append(f"v{version}.created")

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        ran.append(f"v{version}.charged")
        if step.state.get("fail"):
            raise rp.Retryable("provider down")
        return {}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append(f"v{version}.finished")
        return rp.Response(201, {"version": version})

    return op


def test_a_finished_v1_key_replays_through_v2(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    ran: list[str] = []
    v1, v2 = versioned(1, ran), versioned(2, ran)
    engine.register(v1)
    assert engine.run(v1, key="k", params={"origin": "A"}, scope=scope).status == 201

    deployed = rp.Engine(db)
    deployed.register(v1, v2)
    # The client's byte-identical retry, served by v2 (as a FastAPI model of v2, or raw).
    for params in ({"origin": "A"}, RideV2(origin="A")):
        outcome = deployed.run(v2, key="k", params=params, scope=scope)
        assert (outcome.replayed, outcome.body) == (True, {"version": 1})
    with pytest.raises(rp.ParamsMismatch):
        deployed.run(v2, key="k", params={"origin": "B"}, scope=scope)
    assert ran == ["v1.created", "v1.charged", "v1.finished"]


def test_an_unfinished_v1_key_resumes_through_v2(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    ran: list[str] = []
    v1 = versioned(1, ran)
    engine.register(v1)
    failing = Boom()
    with failing.at(v1, "charged"), pytest.raises(rp.Retryable):
        engine.run(v1, key="k", params={"origin": "A"}, scope=scope)

    deployed = rp.Engine(db)
    v2 = versioned(2, ran)
    deployed.register(versioned(1, ran), v2)
    outcome = deployed.run(v2, key="k", params={"origin": "A"}, scope=scope)
    assert (outcome.replayed, outcome.body) == (False, {"version": 1})
    assert ran == ["v1.created", "v1.charged", "v1.charged", "v1.finished"]


class Boom:
    """Makes a foreign step of an operation raise Retryable while inside."""

    def at(self, op: rp.Operation[Any], point: str) -> Any:
        from contextlib import contextmanager

        phase = next(p for p in op.phases if p.point == point)
        original = phase.fn

        @contextmanager
        def failing() -> Any:
            def fn(step: rp.StepContext, params: Any) -> Any:
                original(step, params)
                raise rp.Retryable("provider down")

            index = op.phases.index(phase)
            op.phases[index] = type(phase)(phase.point, phase.kind, fn, phase.jumps_to)
            try:
                yield
            finally:
                op.phases[index] = phase

        return failing()


def test_the_lease_of_a_v1_key_is_judged_by_v1s_lock_timeout(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    ran: list[str] = []
    entered, leave = threading.Event(), threading.Event()
    v1 = versioned(1, ran, lock_timeout=60)
    step = v1.phases[1]

    def slow_charge(ctx: rp.StepContext, params: Any) -> dict[str, Any]:
        ran.append("v1.charged")
        entered.set()
        assert leave.wait(10)
        return {}

    v1.phases[1] = type(step)(step.point, step.kind, slow_charge)
    engine.register(v1)
    thread = threading.Thread(
        target=lambda: engine.run(v1, key="k", params={"origin": "A"}, scope=scope)
    )
    thread.start()
    try:
        assert entered.wait(10)
        with db.begin() as conn:  # held for 5 s: past v2's lock timeout, well inside v1's
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET locked_at = now() - interval '5 seconds' "
                    "WHERE scope = :s"
                ),
                {"s": scope},
            )
        deployed = rp.Engine(db)
        v2 = versioned(2, ran, lock_timeout=1)
        deployed.register(versioned(1, ran, lock_timeout=60), v2)
        with pytest.raises(rp.KeyInUse) as caught:
            deployed.run(v2, key="k", params={"origin": "A"}, scope=scope)
    finally:
        leave.set()
        thread.join()
    assert caught.value.retry_after > 50
    assert ran == ["v1.created", "v1.charged", "v1.finished"]


# -- 6. a committed phase renews the lease from its commit -----------------------------------


@pytest.mark.slow
def test_a_slow_phase_leaves_its_successor_a_whole_lease(engine: rp.Engine, scope: str) -> None:
    entered, leave = threading.Event(), threading.Event()
    steps: list[str] = []
    op: rp.Operation[Any] = rp.Operation("slow_phase", lock_timeout=timedelta(seconds=2))

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        time.sleep(2.5)  # longer than the lock timeout

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> None:
        steps.append("charged")
        entered.set()
        assert leave.wait(10)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    engine.register(op)
    thread = threading.Thread(target=lambda: engine.run(op, key="k", params={}, scope=scope))
    thread.start()
    try:
        assert entered.wait(10)
        with pytest.raises(rp.KeyInUse):
            engine.run(op, key="k", params={}, scope=scope)
    finally:
        leave.set()
        thread.join()
    assert steps == ["charged"]


# -- 7. phase code that ends the engine's transaction is caught ------------------------------


def counting_op(name: str, end: Any, *, opened: bool = False) -> rp.Operation[Any]:
    """Writes an audit record, then ends the transaction with ``end(tx)``, then goes on;
    after a phase that writes nothing if ``opened`` (its key is then resumed at it)."""
    op: rp.Operation[Any] = rp.Operation(name)

    if opened:

        @op.atomic_phase("opened")
        def open_(tx: rp.AtomicContext, params: Any) -> None:
            pass

    @op.atomic_phase("recorded")
    def record(tx: rp.AtomicContext, params: Any) -> None:
        tx.connection.execute(
            sa.text("INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'charge', :k)"),
            {"s": params["scope"], "k": tx.key_id},
        )
        end(tx)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    return op


def _raw(tx: rp.AtomicContext) -> Any:
    return tx.connection.connection.driver_connection


def _libpq(tx: rp.AtomicContext, statement: bytes) -> None:
    """``statement`` through libpq itself, under every guard."""
    _raw(tx).pgconn.exec_(statement)


def _session_rollback_then_write(tx: rp.AtomicContext) -> None:
    tx.session.execute(sa.text("SELECT 1"))
    tx.session.rollback()
    tx.execute(
        "INSERT INTO audit_records (scope, action, key_id) VALUES ('leaked', 'after', 0)"
    )


def _write_again(tx: rp.AtomicContext) -> None:
    tx.connection.execute(sa.text("SELECT pg_current_xact_id()"))


ENDINGS = {
    "connection.commit": (lambda tx: tx.connection.commit(), "refused"),
    "connection.rollback": (lambda tx: tx.connection.rollback(), "refused"),
    "COMMIT statement": (lambda tx: tx.connection.execute(sa.text("COMMIT")), "refused"),
    "end statement": (lambda tx: tx.connection.exec_driver_sql("  end"), "refused"),
    "ROLLBACK statement": (lambda tx: tx.connection.execute(sa.text("rollback")), "refused"),
    "driver commit": (lambda tx: _raw(tx).commit(), "refused"),
    "driver rollback": (lambda tx: _raw(tx).rollback(), "refused"),
    "session rollback, then more": (lambda tx: _session_rollback_then_write(tx), "refused"),
    # libpq's own connection is under every guard: what it ends is found after.
    "libpq commit": (lambda tx: _libpq(tx, b"COMMIT"), "committed"),
    "libpq commit, then more": (
        lambda tx: (_libpq(tx, b"COMMIT"), _write_again(tx)),
        "committed",
    ),
    # A new transaction behind the engine's back: the write that records the phase finds
    # itself in it, raises, and the COMMIT sent with it never runs.
    "libpq commit, then a new transaction": (
        lambda tx: (
            _libpq(tx, b"COMMIT"),
            _libpq(tx, b"BEGIN"),
            _libpq(
                tx,
                b"INSERT INTO audit_records (scope, action, key_id) VALUES ('leaked', 'after', 0)",
            ),
        ),
        "committed",
    ),
    "libpq rollback, then more": (
        lambda tx: (_libpq(tx, b"ROLLBACK"), _write_again(tx)),
        "rolled back",
    ),
}


@pytest.mark.parametrize(("end", "fate"), ENDINGS.values(), ids=ENDINGS.keys())
def test_a_phase_that_ends_the_transaction_fails_and_records_no_point(
    engine: rp.Engine, db: sa.Engine, scope: str, end: Any, fate: str
) -> None:
    op = counting_op("ends_its_transaction", end)
    engine.register(op)
    with pytest.raises(rp.TransactionEnded, match="'recorded'"):
        engine.run(op, key="k", params={"scope": scope}, scope=scope)
    audits = count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope)
    # Refused up front: nothing happened. Found after: the writes the phase committed stand
    # (nothing can undo them), but no recovery point claims them.
    assert audits == (1 if fate == "committed" else 0)
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = 'leaked'") == 0
    rows = count(
        db,
        "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND recovery_point <> 'started'",
        s=scope,
    )
    assert rows == 0


def test_a_resumed_phase_that_commits_is_caught_too(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    calls: list[str] = []

    def end(tx: rp.AtomicContext) -> None:
        calls.append("phase")
        if len(calls) == 1:
            raise rp.Retryable("first attempt fails before ending anything")
        _libpq(tx, b"COMMIT")
        _write_again(tx)

    op = counting_op("ends_when_resumed", end, opened=True)
    engine.register(op)
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", params={"scope": scope}, scope=scope)
    with pytest.raises(rp.TransactionEnded):  # resumed at "opened", on the fenced path
        engine.run(op, key="k", params={"scope": scope}, scope=scope)
    assert key_row(db, scope)["recovery_point"] == "opened"


def test_a_savepoint_rolled_back_is_fine(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    undo = sa.text("INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'undone', 0)")

    def end(tx: rp.AtomicContext) -> None:
        savepoint = tx.connection.begin_nested()
        tx.connection.execute(undo, {"s": scope})
        savepoint.rollback()
        tx.connection.execute(sa.text("SAVEPOINT by_hand"))
        tx.connection.execute(undo, {"s": scope})
        tx.connection.execute(sa.text("ROLLBACK TO SAVEPOINT by_hand"))

    op = counting_op("uses_a_savepoint", end)
    engine.register(op)
    assert engine.run(op, key="k", params={"scope": scope}, scope=scope).status == 201
    actions = count(
        db, "SELECT count(*) FROM audit_records WHERE scope = :s AND action = 'charge'", s=scope
    )
    undone = count(
        db, "SELECT count(*) FROM audit_records WHERE scope = :s AND action = 'undone'", s=scope
    )
    assert (actions, undone) == (1, 0)


# -- 8. a replay is the answer the client got first ------------------------------------------


def test_first_answer_and_replay_are_equal_types_included(engine: rp.Engine, scope: str) -> None:
    op: rp.Operation[Any] = rp.Operation("numbers")
    states: list[dict[str, Any]] = []

    @op.atomic_phase("counted")
    def counted(tx: rp.AtomicContext, params: Any) -> None:
        tx.state.update(big=1e16, huge=1.5e300, small=1e-7, whole=2.0)

    @op.foreign_step("looked")
    def looked(step: rp.StepContext, params: Any) -> None:
        states.append(dict(step.state))
        if len(states) == 1:
            raise rp.Retryable("once")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200, {"big": 1e16, "huge": 1.5e300, "small": 1e-7, "int": 3})

    engine.register(op)
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", params={}, scope=scope)
    first = engine.run(op, key="k", params={}, scope=scope)
    replay = engine.run(op, key="k", params={}, scope=scope)
    assert replay.replayed and not first.replayed
    assert first.body == replay.body
    assert [type(v) for v in first.body.values()] == [type(v) for v in replay.body.values()]
    assert json.dumps(first.body) == json.dumps(replay.body)
    # A fresh run and a resumed one see the same state, types included.
    assert json.dumps(states[0]) == json.dumps(states[1])


# -- a request withdrawn before it did anything leaves no key ---------------------------------


def test_a_withdrawn_first_step_leaves_no_key_and_a_later_one_is_a_failure(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    from recoverypoint.operation import Withdrawn

    withdraw_at: list[str] = ["checked"]
    op: rp.Operation[Any] = rp.Operation("withdrawable")

    @op.foreign_step("checked")
    def check(step: rp.StepContext, params: Any) -> None:
        if "checked" in withdraw_at:
            raise Withdrawn({"status": 401})

    @op.atomic_phase("recorded")
    def record(tx: rp.AtomicContext, params: Any) -> None:
        if "recorded" in withdraw_at:
            raise Withdrawn({"status": 403})

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    engine.register(op)
    with pytest.raises(Withdrawn) as caught:
        engine.run(op, key="k", params={"a": 1}, scope=scope)
    assert caught.value.answer == {"status": 401}
    assert keys_in(db, scope) == 0
    # Other params under the same key are a new request, not a mismatch.
    withdraw_at[:] = ["recorded"]
    with pytest.raises(Withdrawn):
        engine.run(op, key="k", params={"a": 2}, scope=scope)
    # `checked` was committed first: withdrawing now is an ordinary failed attempt.
    row = key_row(db, scope)
    assert (row["recovery_point"], row["attempts"]) == ("checked", 1)
    withdraw_at[:] = []
    assert engine.run(op, key="k", params={"a": 2}, scope=scope).status == 201


# -- the pipelined COMMIT never follows a write that missed its row ---------------------------


def test_a_phase_that_moves_its_own_key_row_commits_nothing(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    def end(tx: rp.AtomicContext) -> None:
        # A new row version: the point's write, addressed by the fence's ctid, misses it.
        tx.execute("UPDATE idempotency_keys SET attempts = attempts WHERE id = %s", (tx.key_id,))

    op = counting_op("moves_its_key_row", end)
    engine.register(op)
    with pytest.raises(rp.LockLost, match="idempotency_keys"):
        engine.run(op, key="k", params={"scope": scope}, scope=scope)
    # The COMMIT queued behind the write did not run: the audit record went with it.
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 0
    assert keys_in(db, scope) == 0


@pytest.mark.parametrize(
    "options",
    [
        {"lock_timeout": timedelta.max},
        {"lock_timeout": timedelta(days=366)},
        {"retention": timedelta(days=40000)},
    ],
    ids=["lock-timeout-max", "lock-timeout-over-a-year", "retention-over-a-century"],
)
def test_leases_and_retentions_sql_cannot_add_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(rp.DeclarationError, match="at most"):
        rp.Operation("too_long", **options)
