"""The request path on real PostgreSQL: claim, phases, recovery points, replay, failures."""

from __future__ import annotations

import contextlib
import threading
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rides import Boom, Faults, Provider, count, ride_operation

import recoverypoint as rp
from recoverypoint.engine._decide import _from_epoch

RIDES = rp.Request("POST", "/rides")


def key_row(db: sa.Engine, scope: str) -> dict[str, Any]:
    with db.connect() as conn:
        return dict(
            conn.execute(
                sa.text("SELECT * FROM idempotency_keys WHERE scope = :s"), {"s": scope}
            )
            .mappings()
            .one()
        )


def test_new_key_runs_every_phase_and_stores_the_response(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)

    outcome = engine.run(op, key="k1", params={"scope": scope}, scope=scope, request=RIDES)

    assert outcome.status == 201
    assert outcome.replayed is False
    assert outcome.body["charge_id"].startswith("ch_")
    row = key_row(db, scope)
    assert row["recovery_point"] == "finished"
    assert row["locked_at"] is None and row["lock_token"] is None
    assert row["response_status"] == 201
    assert row["response_body"] == outcome.body
    assert row["state"] == outcome.body
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    jobs = count(
        db,
        "SELECT count(*) FROM staged_jobs WHERE idempotency_key_id = :k AND job_name = :n",
        k=row["id"],
        n="send_ride_receipt",
    )
    assert jobs == 1


def test_finished_key_replays_without_running_any_phase(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)
    first = engine.run(op, key="k1", params={"scope": scope}, scope=scope, request=RIDES)
    calls_before = dict(faults.calls)

    again = engine.run(op, key="k1", params={"scope": scope}, scope=scope, request=RIDES)

    assert again.replayed is True
    assert (again.status, again.body, again.headers) == (first.status, first.body, first.headers)
    assert dict(faults.calls) == calls_before
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1


def test_replay_keeps_safe_headers_only(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    op: rp.Operation[Any] = rp.Operation("set_prefs")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        headers = {
            "Location": "/prefs/1",
            "X-Request-Cost": "3",
            "Set-Cookie": "session=secret",
            "Connection": "keep-alive",
            "Transfer-Encoding": "chunked",
        }
        return rp.Response(200, {"ok": True}, headers)

    engine.register(op)
    first = engine.run(op, key="k", params={}, scope=scope)
    replay = engine.run(op, key="k", params={}, scope=scope)

    expected = {"Location": "/prefs/1", "X-Request-Cost": "3"}
    assert first.headers == expected
    assert replay.headers == expected and replay.replayed
    assert key_row(db, scope)["response_headers"] == expected


@pytest.mark.parametrize(
    "changed",
    [
        {"params": {"amount": 2}},
        {"request": rp.Request("PUT", "/rides")},
        {"request": rp.Request("POST", "/rides/other")},
    ],
    ids=["params", "method", "path"],
)
@pytest.mark.parametrize("finished", [True, False], ids=["finished", "unfinished"])
def test_reused_key_with_another_request_is_refused(
    engine: rp.Engine, db: sa.Engine, scope: str, changed: dict[str, Any], finished: bool
) -> None:
    op: rp.Operation[Any] = rp.Operation("pay")

    @op.atomic_phase("paid")
    def pay(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.foreign_step("notified")
    def notify(step: rp.StepContext, params: Any) -> None:
        if not finished:
            raise rp.Retryable("provider down")

    @op.atomic_phase("finished")
    def done(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"paid": True})

    engine.register(op)
    original = {"params": {"amount": 1}, "request": RIDES}
    if finished:
        engine.run(op, key="k", scope=scope, **original)
    else:
        # An existing, unfinished key: make one that survives its first failure.
        with pytest.raises(rp.Retryable):
            engine.run(op, key="k", scope=scope, **original)
    rows_before = count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope)

    with pytest.raises(rp.ParamsMismatch) as caught:
        engine.run(op, key="k", scope=scope, **{**original, **changed})

    assert caught.value.http_status == 422
    rows_after = count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope)
    assert rows_after == rows_before


def test_keys_are_scoped_by_scope_and_operation(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    runs: list[str] = []
    ops = []
    for name in ("op_a", "op_b"):
        op: rp.Operation[Any] = rp.Operation(name)

        @op.atomic_phase("finished")
        def finish(tx: rp.AtomicContext, params: Any, name: str = name) -> rp.Response:
            runs.append(name)
            return rp.Response(200, {"op": name})

        ops.append(op)
    engine.register(*ops)

    for op in ops:
        for owner in (scope, scope + "-other"):
            outcome = engine.run(op, key="same-key", params={}, scope=owner)
            assert outcome.replayed is False
    assert sorted(runs) == ["op_a", "op_a", "op_b", "op_b"]


def test_in_flight_key_gives_key_in_use_with_retry_after(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    entered, leave = threading.Event(), threading.Event()
    op: rp.Operation[Any] = rp.Operation("slow")

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.foreign_step("called")
    def call(step: rp.StepContext, params: Any) -> None:
        entered.set()
        assert leave.wait(10)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"done": True})

    engine.register(op)
    results: list[rp.Outcome] = []
    first = threading.Thread(
        target=lambda: results.append(engine.run(op, key="k", params={}, scope=scope))
    )
    first.start()
    assert entered.wait(10)
    try:
        with pytest.raises(rp.KeyInUse) as caught:
            engine.run(op, key="k", params={}, scope=scope)
    finally:
        leave.set()
        first.join()

    assert caught.value.http_status == 409
    assert 1 <= caught.value.retry_after <= 90
    assert results[0].status == 201
    assert engine.run(op, key="k", params={}, scope=scope).replayed


def test_early_response_is_terminal_and_replayed(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)
    params = {"scope": scope, "customer": "cus_declined"}

    declined = engine.run(op, key="k", params=params, scope=scope, request=RIDES)
    again = engine.run(op, key="k", params=params, scope=scope, request=RIDES)

    assert (declined.status, declined.body) == (402, {"error": "card_declined"})
    assert again.replayed and (again.status, again.body) == (402, {"error": "card_declined"})
    assert faults.calls["finished:start"] == 0
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 0
    assert key_row(db, scope)["recovery_point"] == "finished"


def test_recovery_point_jump_skips_phases(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    ran: list[str] = []
    op: rp.Operation[Any] = rp.Operation("maybe_charge")

    @op.atomic_phase("checked", jumps_to=("recorded",))
    def check(tx: rp.AtomicContext, params: Any) -> rp.RecoveryPoint | None:
        ran.append("checked")
        tx.state["free"] = params["free"]
        return rp.RecoveryPoint("recorded") if params["free"] else None

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> None:
        ran.append("charged")

    @op.atomic_phase("recorded")
    def record(tx: rp.AtomicContext, params: Any) -> None:
        ran.append("recorded")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append("finished")
        return rp.Response(200, tx.state)

    engine.register(op)
    assert engine.run(op, key="free", params={"free": True}, scope=scope).body == {"free": True}
    assert ran == ["checked", "finished"]


def test_undeclared_jump_is_refused_and_rolled_back(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("bad_jump")

    @op.atomic_phase("one")
    def one(tx: rp.AtomicContext, params: Any) -> rp.RecoveryPoint:
        return rp.RecoveryPoint("finished")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200)

    engine.register(op)
    with pytest.raises(rp.DeclarationError, match="jumps_to"):
        engine.run(op, key="k", params={}, scope=scope)
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0


def test_last_phase_without_response_finishes_with_204(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("fire_and_forget")

    @op.atomic_phase("done")
    def done(tx: rp.AtomicContext, params: Any) -> None:
        tx.state["x"] = 1

    engine.register(op)
    outcome = engine.run(op, key="k", params={}, scope=scope)
    assert (outcome.status, outcome.body) == (204, None)
    assert engine.run(op, key="k", params={}, scope=scope).status == 204


def test_pydantic_params_are_validated_normalised_and_handed_to_phases(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    from pydantic import BaseModel

    class RideParams(BaseModel):
        origin_lat: float
        origin_lon: float

    seen: list[Any] = []
    op = rp.Operation("typed_ride", params=RideParams)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: RideParams) -> rp.Response:
        seen.append(params)
        return rp.Response(201, params.model_dump())

    engine.register(op)
    outcome = engine.run(op, key="k", params={"origin_lat": "1.5", "origin_lon": 2}, scope=scope)
    # The normalised form is what is fingerprinted, so an equivalent body is a replay.
    again = engine.run(op, key="k", params=RideParams(origin_lat=1.5, origin_lon=2.0), scope=scope)

    assert isinstance(seen[0], RideParams)
    assert outcome.body == {"origin_lat": 1.5, "origin_lon": 2.0}
    assert again.replayed
    assert key_row(db, scope)["request_params"] == {"origin_lat": 1.5, "origin_lon": 2.0}


def test_session_writes_commit_with_the_phase(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("orm")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.session.execute(
            sa.text("INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'orm', :k)"),
            {"s": scope, "k": tx.key_id},
        )
        return rp.Response(200)

    engine.register(op)
    engine.run(op, key="k", params={}, scope=scope)
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1


def test_version_change_resumes_old_keys_with_their_version(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    ran: list[str] = []

    def declare(version: int, fail: bool) -> rp.Operation[Any]:
        op: rp.Operation[Any] = rp.Operation("versioned", version=version)

        @op.atomic_phase("first")
        def first(tx: rp.AtomicContext, params: Any) -> None:
            ran.append(f"v{version}.first")

        @op.foreign_step("second")
        def second(step: rp.StepContext, params: Any) -> None:
            ran.append(f"v{version}.second")
            if fail:
                raise rp.Retryable("try later")

        @op.atomic_phase("finished")
        def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
            ran.append(f"v{version}.finished")
            return rp.Response(200, {"version": version})

        return op

    v1_failing = declare(1, fail=True)
    engine.register(v1_failing)
    with pytest.raises(rp.Retryable):
        engine.run(v1_failing, key="k", params={}, scope=scope)

    # A new deploy: v2 serves new keys, v1 (fixed) stays registered for unfinished ones.
    later = rp.Engine(db)
    v1, v2 = declare(1, fail=False), declare(2, fail=False)
    later.register(v2)
    with pytest.raises(rp.OperationNotRegistered, match="v1"):
        later.run(v2, key="k", params={}, scope=scope)
    assert key_row(db, scope)["recovery_point"] == "first"
    later.register(v1)
    assert later.run(v2, key="k", params={}, scope=scope).body == {"version": 1}
    assert ran == ["v1.first", "v1.second", "v1.second", "v1.finished"]


def test_unregistered_operation_is_refused_and_stores_nothing(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("never_registered")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200)

    with pytest.raises(rp.OperationNotRegistered, match="register"):
        engine.run(op, key="k", params={}, scope=scope)
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0


def test_foreign_steps_run_outside_any_transaction_and_hold_no_connection(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    observed: dict[str, Any] = {}
    op: rp.Operation[Any] = rp.Operation("observe")

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        observed["in_phase"] = db.pool.checkedout()

    @op.foreign_step("called")
    def call(step: rp.StepContext, params: Any) -> None:
        observed["in_step"] = db.pool.checkedout()
        with db.connect() as conn:
            observed["others_in_tx"] = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
                )
            ).scalar_one()

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200)

    engine.register(op)
    engine.run(op, key="k", params={}, scope=scope)

    assert observed["in_phase"] >= 1
    assert observed["in_step"] == 0
    assert observed["others_in_tx"] == 0


def test_downstream_key_is_stable_unique_short_and_hides_the_scope(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    keys: list[tuple[str, str, str]] = []
    op: rp.Operation[Any] = rp.Operation("keys")
    failures = {"n": 1}

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> None:
        keys.append((params["id"], step.downstream_key(), step.downstream_key("refund")))
        if failures["n"]:
            failures["n"] -= 1
            raise Boom("after the foreign call, before its commit")

    @op.foreign_step("emailed")
    def email(step: rp.StepContext, params: Any) -> None:
        keys.append((params["id"], step.downstream_key(), ""))

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200)

    engine.register(op)
    client_key = "client-key-" + uuid.uuid4().hex
    with pytest.raises(Boom):
        engine.run(op, key=client_key, params={"id": "a"}, scope=scope)
    engine.run(op, key=client_key, params={"id": "a"}, scope=scope)
    engine.run(op, key=client_key + "-2", params={"id": "b"}, scope=scope)

    (a1, a1_refund, _), (a1_again, a1_refund_again, _), (_, a2, _), (_, b1, _), _ = keys
    assert (a1, a1_refund) == (a1_again, a1_refund_again)  # same across retries
    assert len({a1, a1_refund, a2, b1}) == 4  # per step, per name, per request
    for derived in (a1, a1_refund, a2, b1):
        assert len(derived) <= 255
        assert scope not in derived and client_key not in derived


def test_downstream_key_does_not_depend_on_the_session_time_zone(
    database_url: str, db: sa.Engine, business_tables: None, scope: str
) -> None:
    """A completer or API process whose sessions run in another TimeZone must hand the
    foreign system the same key."""
    keys: list[str] = []

    def declare() -> rp.Operation[Any]:
        op: rp.Operation[Any] = rp.Operation("tz")

        @op.foreign_step("charged")
        def charge(step: rp.StepContext, params: Any) -> None:
            keys.append(step.downstream_key())
            if len(keys) == 1:
                raise rp.Retryable("first attempt fails after the call")

        @op.atomic_phase("finished")
        def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
            return rp.Response(200)

        return op

    for zone in ("UTC", "Pacific/Kiritimati"):
        zoned = sa.create_engine(database_url, connect_args={"options": f"-c TimeZone={zone}"})
        engine = rp.Engine(zoned)
        op = declare()
        engine.register(op)
        with contextlib.suppress(rp.Retryable):
            engine.run(op, key="k", params={}, scope=scope)
        zoned.dispose()
    assert len(keys) == 2 and keys[0] == keys[1]


def declare_echo(version: int) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("echo_versions", version=version)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200, {"version": version, "params": params})

    return op


def test_a_finished_key_whose_version_is_gone_is_judged_by_the_callers_version(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    v1 = declare_echo(1)
    engine.register(v1)
    first = engine.run(v1, key="k", params={"a": 1}, scope=scope)

    # A later deploy runs v2 only: the finished key still replays what v1 answered.
    later = rp.Engine(db)
    v2 = declare_echo(2)
    later.register(v2)
    again = later.run(v2, key="k", params={"a": 1}, scope=scope)
    assert again.replayed and again.body == first.body == {"version": 1, "params": {"a": 1}}
    with pytest.raises(rp.ParamsMismatch):
        later.run(v2, key="k", params={"a": 2}, scope=scope)
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 1


def test_a_key_that_finishes_between_the_lookup_and_the_claim_is_replayed(
    engine: rp.Engine, db: sa.Engine, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op = declare_echo(1)
    engine.register(op)
    first = engine.run(op, key="k", params={"a": 1}, scope=scope)

    # As if the key finished just after the lookup missed it: the claim finds it finished.
    monkeypatch.setattr(rp.engine.store, "finished_key", lambda *args, **kwargs: (None, 0))
    again = engine.run(op, key="k", params={"a": 1}, scope=scope)
    assert again.replayed and again.body == first.body
    with pytest.raises(rp.ParamsMismatch):
        engine.run(op, key="k", params={"a": 2}, scope=scope)
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 1


def test_a_replay_hands_its_connection_back_to_the_pool_reset(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op = declare_echo(1)
    engine.register(op)
    engine.run(op, key="k", params={}, scope=scope)
    resets: list[bool] = []

    def heard(dbapi_connection: Any, record: Any, state: Any) -> None:
        resets.append(state.transaction_was_reset)

    sa.event.listen(db.pool, "reset", heard)
    try:
        before = db.pool.checkedout()
        assert engine.run(op, key="k", params={}, scope=scope).replayed
    finally:
        sa.event.remove(db.pool, "reset", heard)
    # Back in the pool, idle, with the pool told that its transaction had already ended
    # (so it sent no ROLLBACK of its own), as SQLAlchemy's own Connection does.
    assert db.pool.checkedout() == before
    assert resets == [True]


_TWO_PHASES: rp.Operation[Any] = rp.Operation("two_phases_any_scope")


@_TWO_PHASES.atomic_phase("first")
def _first(tx: rp.AtomicContext, params: Any) -> None:
    tx.stage_job("noted", {})


@_TWO_PHASES.atomic_phase("finished")
def _finished(tx: rp.AtomicContext, params: Any) -> rp.Response:
    # Its transaction begins with the fence, which carries the scope as a quoted literal.
    tx.stage_job("done", {})
    return rp.Response(201, {"ok": True})


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40),
        st.sampled_from(["'", "\\", "\\'", "''; DROP TABLE x; --", "E'\\x41'", " E'", "$$", "é🚀"]),
    )
)
@pytest.mark.slow
def test_any_scope_the_engine_accepts_is_fenced_and_replayed_in_its_own_scope(
    db: sa.Engine, scope: str
) -> None:
    """Quotes, backslashes, any script: the scope written into the fence's text (libpq's
    quoting) finds the key's row, and the key's jobs carry the scope."""
    engine = rp.Engine(db)
    engine.register(_TWO_PHASES)
    key = uuid.uuid4().hex
    try:
        first = engine.run(_TWO_PHASES, key=key, params={}, scope=scope)
    except rp.InvalidParams:
        return  # a scope the engine refuses stores nothing (tests/test_bad_input.py)
    again = engine.run(_TWO_PHASES, key=key, params={}, scope=scope)
    assert (first.status, again.replayed) == (201, True)
    jobs = (
        "SELECT count(*) FROM staged_jobs j JOIN idempotency_keys k ON k.id = j.idempotency_key_id"
    )
    jobs += " WHERE k.idempotency_key = :key AND j.scope = k.scope AND k.scope = :scope"
    assert count(db, jobs, key=key, scope=scope) == 2


@settings(max_examples=60)
@given(
    st.datetimes(
        min_value=datetime(1970, 1, 1),
        max_value=datetime(9999, 12, 31),
        timezones=st.just(timezone.utc),
    )
)
def test_a_new_keys_creation_time_is_the_one_read_back_later(db: sa.Engine, at: datetime) -> None:
    """The claim returns a new row's creation time as seconds since the epoch (a number
    Citus lets it return); later reads of the row, as text. Both give the same instant, to
    the microsecond: the key's identity, which phases see, does not change on resume."""
    with db.connect() as conn:
        as_number, as_text = conn.execute(
            sa.text(
                "SELECT extract(epoch FROM timezone('UTC', CAST(:at AS timestamptz)))::text, "
                "to_char(CAST(:at AS timestamptz) AT TIME ZONE 'UTC', "
                "'YYYY-MM-DD\"T\"HH24:MI:SS.US')"
            ),
            {"at": at},
        ).one()
    read_later = datetime.fromisoformat(as_text).replace(tzinfo=timezone.utc)
    assert _from_epoch(as_number) == read_later == at
