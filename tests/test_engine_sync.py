# Generated from tests/test_engine_async.py by tools/async_to_sync.py:
# edit tests/test_engine_async.py, then run tools/async_to_sync.py.
"""rp.Engine's guarantees, against real PostgreSQL: a new key runs every phase, then
replays; a key reused with other params is refused, one in flight is in use; a failure
anywhere resumes from the recovery point and charges once; fifty callers racing on one key
make one effect; a takeover fences the old owner out; serialization failures are retried;
context variables reach the phases; ORM sessions write in the phase's one transaction,
which only the engine commits."""

from __future__ import annotations

import contextvars
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from acompat import Event, gather, join, spawn, wait_set
from rides import Provider, count

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.keys import derived_key_of, legacy_key_material

REQUEST = rp.Request("POST", "/rides")
# The engine's connections, told apart from those of other tests on the same database.
APPLICATION = "recoverypoint-engine-tests"
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="nobody")


@pytest.fixture
def engine(database_url: str, business_tables: None) -> Iterator[rp.Engine]:
    db = sa.create_engine(
        normalize_url(database_url),
        pool_size=5,
        max_overflow=15,
        connect_args={"application_name": APPLICATION},
    )
    engine = rp.Engine(db, serialization_retries=30)
    yield engine
    assert db.pool.checkedout() == 0, "a connection was left checked out"  # type: ignore[attr-defined]
    engine.dispose()
    db.dispose()


class Gate:
    """Where a test stops a request: a named hook every phase calls."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[], None]] = {}
        self.seen: list[str] = []

    def at(self, name: str) -> None:
        self.seen.append(name)
        hook = self.hooks.get(name)
        if hook is not None:
            hook()


def rides(name: str, provider: Provider, gate: Gate, **options: Any) -> rp.Operation[Any]:
    """create ride (+audit) → charge at the provider → record charge, stage receipt, 201."""
    op: rp.Operation[Any] = rp.Operation(name, **options)

    @op.atomic_phase("ride_created")
    def create_ride(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        gate.at("ride_created:start")
        tx.state["ride_id"] = tx.scalar(
            "INSERT INTO rides (key_id, scope) VALUES (%s, %s) RETURNING id",
            (tx.key_id, params["scope"]),
        )
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'ride.created', %s)",
            (params["scope"], tx.key_id),
        )
        tx.state["caller"] = CALLER.get()
        gate.at("ride_created:end")

    @op.foreign_step("charge_created")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> Any:
        gate.at("charge_created:start")
        if params.get("customer") == "cus_declined":
            return rp.Response(402, {"error": "card_declined"})
        key, scope = step.downstream_key(), params["scope"]
        charge_id = provider.charge(key, scope, 2000)
        gate.at("charge_created:end")
        return {"charge_id": charge_id}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        gate.at("finished:start")
        result = tx.connection.execute(
            sa.text("UPDATE rides SET charge_id = :c WHERE id = :i RETURNING id"),
            {"c": tx.state["charge_id"], "i": tx.state["ride_id"]},
        )
        assert result.scalar_one() == tx.state["ride_id"]
        tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
        gate.at("finished:end")
        body = {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
        return rp.Response(201, body, {"Location": f"/rides/{tx.state['ride_id']}"})

    return op


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def op(engine: rp.Engine, provider: Provider, gate: Gate) -> rp.Operation[Any]:
    operation = rides(f"rides_{uuid.uuid4().hex[:8]}", provider, gate)
    engine.register(operation)
    return operation


def key_row(db: sa.Engine, scope: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT id, recovery_point, locked_at, lock_token, attempts, last_error, "
                "response_status "
                "FROM idempotency_keys WHERE scope = :s"
            ),
            {"s": scope},
        ).one_or_none()


def staged_job_keys(db: sa.Engine, key_id: int) -> list[str]:
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT job_key FROM staged_jobs WHERE idempotency_key_id = :i ORDER BY id"
                ),
                {"i": key_id},
            ).scalars()
        )


def test_new_key_runs_every_phase_then_replays(
    engine: rp.Engine, op: rp.Operation[Any], db: sa.Engine, scope: str, gate: Gate
) -> None:
    params = {"scope": scope}
    first = engine.run(op, key="k1", scope=scope, params=params, request=REQUEST)
    assert first.status == 201 and not first.replayed
    assert first.headers == {"Location": f"/rides/{first.body['ride_id']}"}
    again = engine.run(op, key="k1", scope=scope, params=params, request=REQUEST)
    assert again.replayed and (again.status, again.body, again.headers) == (
        first.status,
        first.body,
        first.headers,
    )
    assert gate.seen.count("ride_created:start") == 1
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1
    row = key_row(db, scope)
    assert row.recovery_point == "finished" and row.lock_token is None
    jobs = count(db, "SELECT count(*) FROM staged_jobs WHERE idempotency_key_id = :i", i=row.id)
    assert jobs == 1  # committed with the phase that staged it


def test_reused_key_with_other_params_is_refused(
    engine: rp.Engine, op: rp.Operation[Any], scope: str
) -> None:
    engine.run(op, key="k", scope=scope, params={"scope": scope}, request=REQUEST)
    with pytest.raises(rp.ParamsMismatch):
        engine.run(op, key="k", scope=scope, params={"scope": "x"}, request=REQUEST)


def test_in_flight_key_is_in_use(
    engine: rp.Engine, op: rp.Operation[Any], scope: str, gate: Gate
) -> None:
    inside, leave = Event(), Event()

    def hold() -> None:
        inside.set()
        leave.wait()

    gate.hooks["charge_created:start"] = hold
    params = {"scope": scope}
    first = spawn(engine.run, op, key="k", scope=scope, params=params)
    inside.wait()
    with pytest.raises(rp.KeyInUse) as refused:
        engine.run(op, key="k", scope=scope, params=params)
    assert refused.value.retry_after >= 1
    leave.set()
    outcome = join(first)
    assert outcome.status == 201


@pytest.mark.parametrize(
    "where",
    [
        "ride_created:start",
        "ride_created:end",
        "charge_created:start",
        "charge_created:end",
        "finished:start",
        "finished:end",
    ],
)
def test_a_failure_anywhere_resumes_and_charges_once(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    gate: Gate,
    provider: Provider,
    where: str,
) -> None:
    def boom() -> None:
        gate.hooks.pop(where)
        raise rp.Retryable(where)

    gate.hooks[where] = boom
    params = {"scope": scope}
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    row = key_row(db, scope)
    if row is None:  # a new key's first phase failed: it left nothing behind
        assert where.startswith("ride_created")
        assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 0
        resumed = engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    else:  # resume in-process, as the completer does
        assert row.lock_token is None and row.attempts == 1 and where in row.last_error
        resumed = engine.resume(row.id)
    assert resumed.status == 201 and not resumed.replayed
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    assert len(set(provider.keys_seen)) == 1
    replayed = engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    assert replayed.replayed and replayed.body == resumed.body


def test_a_lost_key_row_hands_the_provider_the_same_keys_again(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    provider: Provider,
) -> None:
    # A failover to a lagging standby loses the key row and the phases' rows of the last
    # moments, not the charge the provider made: the client's retry must hand the provider
    # the same downstream key, and the job consumer the same job key.
    params = {"scope": scope}
    first = engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    lost = key_row(db, scope)
    assert first.status == 201 and lost is not None
    job_keys = staged_job_keys(db, lost.id)
    with db.begin() as conn:
        for table, column in (("staged_jobs", "idempotency_key_id"), ("idempotency_keys", "id")):
            conn.execute(sa.text(f"DELETE FROM {table} WHERE {column} = :i"), {"i": lost.id})
        conn.execute(sa.text("DELETE FROM rides WHERE scope = :s"), {"s": scope})
    again = engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    assert again.status == 201 and not again.replayed
    claimed = key_row(db, scope)
    assert claimed is not None and claimed.id != lost.id
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    assert len(provider.keys_seen) == 2 and len(set(provider.keys_seen)) == 1
    assert again.body["charge_id"] == first.body["charge_id"]
    assert staged_job_keys(db, claimed.id) == job_keys


def test_databases_with_other_namespaces_derive_other_keys(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    provider: Provider,
) -> None:
    # Two databases sharing one provider account (staging and production, two shards)
    # must not hand it the same key for their own requests: one engine on the test
    # database's own namespace, one told another; both take the same request.
    params = {"scope": scope}
    with db.connect() as conn:
        stored = conn.execute(sa.text("SELECT namespace FROM recoverypoint_namespace")).scalar()
    assert stored and len(stored) == 36  # made at random by migration 0009
    engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    other = rp.Engine(engine.db, namespace="another-database")
    other.register(op)
    with db.begin() as conn:  # the same request, in "another database"
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE scope = :s"), {"s": scope})
    other.run(op, key="k", scope=scope, params=params, request=REQUEST)
    assert engine.namespace == stored and other.namespace == "another-database"
    assert len(set(provider.keys_seen)) == 2
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 2


def test_a_key_claimed_before_seeds_keeps_its_downstream_keys(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    gate: Gate,
    provider: Provider,
) -> None:
    # A key in flight while a deployment upgrades: its row has no seed (claimed by a
    # release before migration 0009), and the provider already has the key derived from
    # its id and creation time. Resumed after the upgrade, it hands out that key again.
    def boom() -> None:
        gate.hooks.pop("finished:start")
        raise rp.Retryable("stop after the charge")

    gate.hooks["finished:start"] = boom
    params = {"scope": scope}
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", scope=scope, params=params, request=REQUEST)
    row = key_row(db, scope)
    assert row is not None
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET derivation_seed = NULL WHERE id = :i"),
            {"i": row.id},
        )
        created_at = conn.execute(
            sa.text("SELECT created_at FROM idempotency_keys WHERE id = :i"), {"i": row.id}
        ).scalar_one()
    material = legacy_key_material(row.id, created_at, op.name)
    legacy = derived_key_of(material, "downstream", "charge_created", "")
    with db.begin() as conn:  # the charge as the old release made it
        conn.execute(sa.text("DELETE FROM provider_charges WHERE scope = :s"), {"s": scope})
    provider.charge(legacy, scope, 2000)
    with db.begin() as conn:  # and its recovery point: before the charge's result landed
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET recovery_point = 'ride_created', "
                "state = state - 'charge_id' WHERE id = :i"
            ),
            {"i": row.id},
        )
    resumed = engine.resume(row.id)
    assert resumed.status == 201
    assert provider.keys_seen[-1] == legacy
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1


def test_fifty_callers_racing_one_key_run_the_phase_once(
    engine: rp.Engine, op: rp.Operation[Any], db: sa.Engine, scope: str
) -> None:
    params = {"scope": scope}

    def attempt() -> rp.Outcome | Exception:
        while True:
            try:
                return engine.run(op, key="race", scope=scope, params=params)
            except rp.KeyInUse:
                time.sleep(0.01)
            except rp.ConcurrentUpdate as exc:
                return exc

    outcomes = gather(*[attempt] * 50)
    done = [o for o in outcomes if isinstance(o, rp.Outcome)]
    assert done and all(o.body == done[0].body for o in done)
    assert sum(not o.replayed for o in done) == 1
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1


def test_a_takeover_makes_the_old_owner_lose_its_lock(
    engine: rp.Engine, provider: Provider, db: sa.Engine, scope: str, gate: Gate
) -> None:
    op = rides(f"takeover_{uuid.uuid4().hex[:8]}", provider, gate)
    engine.register(op)
    inside, leave = Event(), Event()

    def stall() -> None:
        gate.hooks.pop("charge_created:end")
        inside.set()
        leave.wait()

    gate.hooks["charge_created:end"] = stall
    params = {"scope": scope}
    slow = spawn(engine.run, op, key="k", scope=scope, params=params)
    inside.wait()
    with db.begin() as conn:  # the lease expires
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET locked_at = now() - interval '1 hour' WHERE scope = :s"
            ),
            {"s": scope},
        )
    taker = engine.run(op, key="k", scope=scope, params=params)
    assert taker.status == 201
    leave.set()
    with pytest.raises(rp.LockLost):
        join(slow)
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    assert key_row(db, scope).recovery_point == "finished"


def test_serialization_failures_are_retried(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    """Two phases that read and write the same counter under SERIALIZABLE: one of each
    conflicting pair fails with 40001, is retried in-process, and every run counts once."""
    name = f"counter_{scope}"
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO counters (name, n) VALUES (:n, 0)"), {"n": name})
    op: rp.Operation[Any] = rp.Operation(f"count_{uuid.uuid4().hex[:8]}")
    retries: list[str] = []
    all_read = Event()

    @op.atomic_phase("finished")
    def bump(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        n = tx.scalar("SELECT n FROM counters WHERE name = %s", (name,))
        retries.append("ran")
        # The 8 first runs all read the same n before any writes it: no run can start
        # again before one of them has committed, so these are the first 8 to get here.
        if len(retries) <= 8:
            if len(retries) == 8:
                all_read.set()
            wait_set(all_read)
        tx.execute("UPDATE counters SET n = %s WHERE name = %s", (n + 1, name))
        return rp.Response(200, {"n": n + 1})

    engine.register(op)
    outcomes = gather(
        *(functools.partial(engine.run, op, key=f"k{i}", scope=scope, params={}) for i in range(8))
    )
    assert sorted(o.body["n"] for o in outcomes) == list(range(1, 9))
    # The 7 first runs that read the n the first to commit changed failed, and ran again.
    assert len(retries) >= 15
    assert count(db, "SELECT n FROM counters WHERE name = :n", n=name) == 8


def test_context_variables_reach_every_phase(
    engine: rp.Engine, op: rp.Operation[Any], db: sa.Engine, scope: str
) -> None:
    token = CALLER.set("alice")
    try:
        outcome = engine.run(op, key="k", scope=scope, params={"scope": scope})
    finally:
        CALLER.reset(token)
    assert outcome.status == 201
    with db.connect() as conn:
        state = conn.execute(
            sa.text("SELECT state FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        ).scalar_one()
    assert state["caller"] == "alice"


def test_an_orm_session_writes_in_the_phase_transaction(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def write(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.session.execute(
            sa.text("INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'orm', :k)"),
            {"s": scope, "k": tx.key_id},
        )
        tx.session.commit()  # does not end the phase's transaction
        if params.get("fail"):
            raise rp.Retryable("after the write")
        return rp.Response(201)

    engine.register(op)
    with pytest.raises(rp.Retryable):
        engine.run(op, key="a", scope=scope, params={"fail": True})
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 0
    outcome = engine.run(op, key="b", scope=scope, params={})
    assert outcome.status == 201
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1


def test_committing_from_a_phase_is_refused(engine: rp.Engine, db: sa.Engine, scope: str) -> None:
    op: rp.Operation[Any] = rp.Operation(f"commit_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def sneaky(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'x', 1)", (scope,)
        )
        tx.connection.commit()

    engine.register(op)
    with pytest.raises(rp.TransactionEnded):
        engine.run(op, key="k", scope=scope, params={})
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 0


@pytest.mark.parametrize("status", [None, True, "201", 201.0, 99, 600], ids=str)
def test_a_response_without_an_http_status_is_refused_and_nothing_commits(
    engine: rp.Engine, db: sa.Engine, scope: str, status: Any
) -> None:
    """Every retry replays a finished key's status: a phase's Response without one it can
    replay (no CHECK constraint keeps such a row out since migration 0017) is refused
    before COMMIT, its writes rolled back with it, and the key released, its attempt
    counted."""
    op: rp.Operation[Any] = rp.Operation(f"status_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("started_work")
    def start(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        return None

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'x', 1)", (scope,)
        )
        return rp.Response(status)

    engine.register(op)
    with pytest.raises(TypeError, match="give an HTTP status, an int from 100 to 599"):
        engine.run(op, key="k", scope=scope, params={})
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 0
    row = key_row(db, scope)
    assert (row.recovery_point, row.lock_token, row.response_status) == ("started_work", None, None)
    assert "give an HTTP status" in row.last_error


@pytest.mark.parametrize(
    "result",
    [
        "charged",  # not a dict, None or a Response
        {"receipt": "a\x00b"},  # NUL: jsonb refuses it
        {"amount": float("nan")},
        {"card": object()},
        rp.Response(200, {"receipt": "\ud800"}),
        rp.Response(200, {"ok": True}, {"x-note": "a\x00b"}),  # a header that is stored
        rp.Response(200, {"ok": True}, ["not", "a", "mapping"]),  # type: ignore[arg-type]
        rp.Response(None),  # type: ignore[arg-type]  # no status: a row never replayed
        rp.Response(True),  # a bool is no HTTP status
    ],
    ids=[
        "str",
        "nul",
        "nan",
        "object",
        "surrogate",
        "header-nul",
        "headers-list",
        "status-none",
        "status-bool",
    ],
)
def test_a_step_result_that_cannot_be_stored_finishes_the_key_and_never_runs_again(
    engine: rp.Engine, db: sa.Engine, scope: str, result: object
) -> None:
    """The step ran, so its effect may have happened: it used to run again on every retry.
    The key finishes with a 500 problem answer that says so, replayed to every retry."""
    op: rp.Operation[Any] = rp.Operation(f"unstorable_{uuid.uuid4().hex[:8]}")
    calls: list[int] = []

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> Any:
        calls.append(step.key_id)
        return result

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        return rp.Response(201)

    engine.register(op)
    outcomes = [engine.run(op, key="k", scope=scope, params={}) for _ in range(3)]
    assert len(calls) == 1
    assert [(o.status, o.replayed) for o in outcomes] == [(500, False), (500, True), (500, True)]
    assert outcomes[0].headers == {"content-type": "application/problem+json"}
    assert outcomes[0].body["type"].endswith(":step-result-not-recorded")
    assert "not done again" in outcomes[0].body["detail"]
    row = key_row(db, scope)
    assert (row.recovery_point, row.lock_token, row.response_status) == ("finished", None, 500)
