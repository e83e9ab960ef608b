"""The operator library (recoverypoint.admin) on a real database: every key lands in the
one state it is in, listings find exactly what their filters say, ``show`` explains a key
as the engine ran it, and every action changes exactly the rows it reports, refuses what
it must, and is fenced against the rows changing between its read and its write."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from workload import Recorder, plant_keys, rows, stage_jobs, steps_operation

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.admin import _sql as admin_sql
from recoverypoint.admin import key_actions
from recoverypoint.workers import Completer

# Columns (SQL expressions) of a key in each state, as time and requests leave them (a
# claim stores its lock timeout with its lease: 90 s, Operation's default).
HELD = {"lock_token": "gen_random_uuid()", "lock_timeout": "90"}
LIVE = {"locked_at": "now() - interval '10 seconds'", **HELD}
EXPIRED = {"locked_at": "now() - interval '1 hour'", **HELD}
OVERDUE = {"next_attempt_at": "now() - interval '10 minutes'"}
WAITING = {"next_attempt_at": "now() + interval '1 minute'"}
FINISHED = {"response_status": "201", "finished_at": "now() - interval '1 hour'"}
ABANDONED = {**FINISHED, "response_status": "500", "abandoned_at": "now() - interval '1 hour'"}


def plant(db: sa.Engine, operation: str = "op", count: int = 1, **columns: Any) -> list[int]:
    point = columns.pop("point", "finished" if "finished_at" in columns else "reserved")
    return plant_keys(db, operation, count, point=point, **columns)


def key(db: sa.Engine, key_id: int) -> Any:
    [row] = rows(db, "SELECT * FROM idempotency_keys WHERE id = :id", id=key_id)
    return row


def snapshot(db: sa.Engine) -> dict[int, Any]:
    return {r.id: tuple(r) for r in rows(db, "SELECT * FROM idempotency_keys ORDER BY id")}


def assert_only_changed(before: dict[int, Any], after: dict[int, Any], ids: set[int]) -> None:
    assert {i for i in before if before[i] != after.get(i)} == ids


@pytest.fixture
def ops(worker_db: sa.Engine) -> admin.Admin:
    return admin.Admin(worker_db, actor="tester@test")


@pytest.fixture
def steps(worker_db: sa.Engine) -> rp.Engine:
    engine = rp.Engine(worker_db)
    engine.register(steps_operation("steps", Recorder(worker_db)))
    return engine


# -- reading -----------------------------------------------------------------------------


def test_each_key_is_in_exactly_one_state(ops: admin.Admin) -> None:
    db = ops.db
    planted = {
        "in-flight": plant(db, **LIVE, **OVERDUE),
        "stuck": plant(db, **OVERDUE) + plant(db, **EXPIRED, **OVERDUE),
        "unfinished": plant(db, **WAITING)
        + plant(db, **EXPIRED, **WAITING)
        + plant(db, next_attempt_at="now() - interval '1 minute'"),  # due, not yet stuck
        "finished": plant(db, **FINISHED),
        "abandoned": plant(db, **ABANDONED),
        "needs-reconciliation": plant(db, **OVERDUE, reconcile_since="now()"),
    }
    for state, ids in planted.items():
        found = admin.list_keys(ops, admin.KeyFilter(states=(state,)))
        assert sorted(r.id for r in found) == ids, state
        assert {r.state for r in found} == {state}
    both = admin.list_keys(ops, admin.KeyFilter(states=("stuck", "in-flight")))
    assert sorted(r.id for r in both) == sorted(planted["stuck"] + planted["in-flight"])
    assert admin.stats(ops).by_state == {s: len(ids) for s, ids in planted.items()}


@pytest.mark.slow
def test_a_lease_is_judged_by_the_lock_timeout_its_holder_stored(ops: admin.Admin) -> None:
    [held] = plant(ops.db, "slow", locked_at="now() - interval '5 minutes'",
                   lock_token="gen_random_uuid()", lock_timeout="600", **OVERDUE)  # fmt: skip
    # The operation is not known here: its ten minutes are, from the row.
    [row] = admin.list_keys(ops, admin.KeyFilter(ids=(held,)))
    assert (row.state, row.lock_timeout, row.live) == ("in-flight", 600.0, True)
    assert 290 < (row.lease_left or 0) <= 300
    slow: rp.Operation[Any] = rp.Operation("slow", lock_timeout=timedelta(minutes=10))
    knowing = dataclasses.replace(ops, operations=(slow,))
    [row] = admin.list_keys(knowing, admin.KeyFilter(ids=(held,)))
    assert (row.state, row.lock_timeout, row.live) == ("in-flight", 600.0, True)


@pytest.mark.slow
def test_filters_select_exactly_their_keys_newest_first(ops: admin.Admin) -> None:
    db = ops.db
    old = plant(db, "a", 2, created_at="now() - interval '2 days'")
    new = plant(db, "a", 2, version=2)
    other = plant(db, "b", 1, **FINISHED)
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE idempotency_keys SET scope = 'alice' WHERE id = :i"),
                     {"i": new[0]})  # fmt: skip

    def ids(**criteria: Any) -> list[int]:
        return [r.id for r in admin.list_keys(ops, admin.KeyFilter(**criteria))]

    assert ids() == [*other, *reversed(new), *reversed(old)]
    assert ids(operation="a") == [*reversed(new), *reversed(old)]
    assert ids(operation="a", version=2) == list(reversed(new))
    assert ids(scope="alice") == [new[0]]
    assert ids(status=201) == other
    assert ids(point="finished") == other
    assert ids(until=datetime.now(timezone.utc) - timedelta(days=1)) == list(reversed(old))
    assert set(ids(since=datetime.now(timezone.utc) - timedelta(hours=1))) == {*new, *other}
    assert ids(operation="a", limit=1) == [new[1]]
    [row] = admin.list_keys(ops, admin.KeyFilter(ids=(new[0],)))
    assert ids(key=row.key) == [new[0]]


@pytest.mark.slow
def test_scopes_and_params_are_masked_unless_revealed(ops: admin.Admin) -> None:
    [key_id] = plant(ops.db, params={"card": "4242424242424242", "n": [7]})
    [masked] = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)))
    [shown] = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)), reveal=True)
    assert shown.scope == "planted"
    assert masked.scope.startswith("…#") and "pl" not in masked.scope  # not a character
    assert masked.scope == ops.mask("planted")  # stable: the same scope masks the same
    detail = admin.find_key(ops, key_id)
    assert detail.request_params == {"card": ops.mask("4242424242424242"), "n": [ops.mask("7")]}
    assert "4242424242424242" not in repr(detail)
    assert admin.find_key(ops, key_id, reveal=True).request_params["card"] == "4242424242424242"


@pytest.mark.slow
def test_show_explains_a_key_as_the_engine_ran_it(ops: admin.Admin, steps: rp.Engine) -> None:
    operation = steps.operation("steps", 1)
    outcome = steps.run(operation, key="k1", scope="alice", params={},
                        request=rp.Request("POST", "/charges"))  # fmt: skip
    [key_id] = [r.id for r in rows(ops.db, "SELECT id FROM idempotency_keys")]
    knowing = admin.Admin.for_engine(steps)

    detail = admin.find_key(knowing, scope="alice", operation="steps", key="k1", reveal=True)

    assert detail.row.id == key_id and detail.row.state == "finished"
    assert (detail.request_method, detail.request_path) == ("POST", "/charges")
    assert detail.response_body == outcome.body and detail.row.status == 201
    # The step returned step.downstream_key(): show computes the same key.
    charged = next(p for p in detail.phases if p.point == "charged")
    assert charged.kind == "foreign" and charged.downstream_key == outcome.body["charge"]
    assert [(p.point, p.mark) for p in detail.phases] == [
        ("started", "done"), ("reserved", "done"), ("charged", "done"), ("finished", "current")
    ]  # fmt: skip
    assert [j.job_name for j in detail.jobs] == ["notify"]
    assert detail.jobs[0].idempotency_key_id == key_id
    assert detail.reaped_after == detail.row.finished_at + admin.DEFAULT_RETENTION  # type: ignore[operator]
    # Without the operations: the stored point only, the default lock timeout.
    bare = admin.find_key(ops, key_id)
    assert bare.phases == () and not bare.known and bare.row.point == "finished"
    with pytest.raises(admin.NotFound):
        admin.find_key(ops, key_id + 1000)


@pytest.mark.slow
def test_show_marks_the_point_of_an_unfinished_key_and_its_lease(
    ops: admin.Admin, steps: rp.Engine
) -> None:
    [key_id] = plant(ops.db, "steps", point="reserved", **LIVE)
    detail = admin.find_key(admin.Admin.for_engine(steps), key_id)
    assert [p.mark for p in detail.phases] == ["done", "current", "pending", "pending"]
    assert detail.row.state == "in-flight" and detail.known
    assert detail.lease_expires_at == detail.row.locked_at + timedelta(seconds=90)  # type: ignore[operator]
    assert detail.reaped_after is None


@pytest.mark.slow
def test_stats_count_by_operation_state_and_point(ops: admin.Admin) -> None:
    plant(ops.db, "a", 2, **OVERDUE)
    plant(ops.db, "a", 1, point="charged", **WAITING)
    plant(ops.db, "b", 3, **FINISHED)
    stage_jobs(ops.db, 4)
    figures = admin.stats(ops)
    groups = {(g.operation, g.state, g.point): g.keys for g in figures.groups}
    assert groups == {
        ("a", "stuck", "reserved"): 2,
        ("a", "unfinished", "charged"): 1,
        ("b", "finished", "finished"): 3,
    }
    assert figures.staged_jobs == 4 and figures.failing_jobs == 0
    assert figures.oldest_unfinished is not None and figures.oldest_unfinished >= 0


# -- actions -----------------------------------------------------------------------------


@pytest.mark.slow
def test_retry_makes_unfinished_keys_due_and_nothing_else(ops: admin.Admin) -> None:
    [waiting] = plant(ops.db, attempts="3", next_attempt_at="now() + interval '1 hour'")
    [done] = plant(ops.db, **FINISHED)
    before = snapshot(ops.db)

    result = admin.retry(ops, waiting, reset_attempts=True)

    assert result.changed == (waiting,)
    assert_only_changed(before, snapshot(ops.db), {waiting})
    row = admin.list_keys(ops, admin.KeyFilter(ids=(waiting,)))[0]
    assert row.attempts == 0 and row.next_attempt_in <= 0
    with pytest.raises(admin.Refused, match="finished"):
        admin.retry(ops, done)


@pytest.mark.slow
def test_a_bulk_retry_takes_the_filters_and_passes_over_finished_keys(ops: admin.Admin) -> None:
    stuck = plant(ops.db, "a", 3, **OVERDUE)
    plant(ops.db, "b", 2, **OVERDUE)
    finished = plant(ops.db, "a", 1, **FINISHED)
    before = snapshot(ops.db)

    dry = admin.retry(ops, admin.KeyFilter(operation="a"), dry_run=True)
    assert (dry.matched, sorted(dry.eligible), dry.changed) == (4, stuck, ())
    assert snapshot(ops.db) == before
    result = admin.retry(ops, admin.KeyFilter(operation="a"))

    assert sorted(result.changed) == stuck and result.matched == 4
    assert finished[0] not in result.eligible
    assert_only_changed(before, snapshot(ops.db), set(stuck))


@pytest.mark.slow
def test_release_clears_an_expired_lease_and_refuses_a_live_one(ops: admin.Admin) -> None:
    [expired] = plant(ops.db, **EXPIRED)
    [live] = plant(ops.db, **LIVE)
    [free] = plant(ops.db)
    before = snapshot(ops.db)

    assert admin.release(ops, expired).changed == (expired,)
    with pytest.raises(admin.Refused, match=r"live lease.*--force"):
        admin.release(ops, live)
    with pytest.raises(admin.Refused, match="no lease"):
        admin.release(ops, free)
    assert_only_changed(before, snapshot(ops.db), {expired})
    assert admin.release(ops, live, force=True).changed == (live,)
    assert (key(ops.db, live).lock_token, key(ops.db, live).locked_at) == (None, None)


@pytest.mark.slow
def test_an_action_leaves_a_key_whose_lease_changed_since_it_was_read(ops: admin.Admin) -> None:
    """The fence: each UPDATE re-checks the token it was decided on."""
    [key_id] = plant(ops.db, **EXPIRED)
    [seen] = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)))
    # Meanwhile a request took the key over: a new token, a live lease.
    with ops.db.begin() as conn:
        conn.execute(sa.text("UPDATE idempotency_keys SET lock_token = gen_random_uuid(), "
                             "locked_at = now() WHERE id = :i"), {"i": key_id})  # fmt: skip
    before = snapshot(ops.db)
    for statement, params in [
        (key_actions._RELEASE, {"force": True}),
        (key_actions._RELEASE, {"force": False}),
        (key_actions._ABANDON, {"force": True, "status": 500, "body": "{}"}),
        (key_actions._ABANDON, {"force": False, "status": 500, "body": "{}"}),
        (key_actions._DELETE, {"force": True}),
    ]:
        changed, _ = key_actions._apply(ops, "keys.test", statement, [seen], params, matched=1)
        assert changed == ()
    assert snapshot(ops.db) == before


@pytest.mark.slow
def test_abandon_stores_an_error_response_that_retries_replay(
    ops: admin.Admin, steps: rp.Engine
) -> None:
    operation = steps.operation("steps", 1)
    with pytest.raises(RuntimeError):
        steps.run(operation, key="k", params={"fail": "charged"})
    [key_id] = [r.id for r in rows(ops.db, "SELECT id FROM idempotency_keys")]

    result = admin.abandon(ops, key_id, status=503, message="provider gone; call support")

    assert result.changed == (key_id,)
    replay = steps.run(operation, key="k", params={"fail": "charged"})
    assert replay.replayed and replay.status == 503
    assert replay.body == {"error": "request_abandoned", "message": "provider gone; call support"}
    row = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)))[0]
    assert row.state == "abandoned" and row.point == "reserved"
    with pytest.raises(admin.Refused, match="already abandoned"):
        admin.abandon(ops, key_id)
    with pytest.raises(ValueError, match="400 to 599"):
        admin.abandon(ops, key_id, status=200)


def test_abandon_refuses_a_live_lease_unless_forced(ops: admin.Admin) -> None:
    [live] = plant(ops.db, **LIVE)
    with pytest.raises(admin.Refused, match="--force"):
        admin.abandon(ops, live)
    assert key(ops.db, live).finished_at is None
    assert admin.abandon(ops, live, force=True).changed == (live,)
    assert key(ops.db, live).lock_token is None


@pytest.mark.slow
def test_reopen_gives_an_abandoned_key_back_to_the_completer(
    ops: admin.Admin, steps: rp.Engine
) -> None:
    [key_id] = plant(ops.db, "steps", point="reserved", attempts="10",
                     last_run_at="now() - interval '1 hour'", **ABANDONED)  # fmt: skip
    [other] = plant(ops.db, **FINISHED)
    with pytest.raises(admin.Refused, match="only abandoned keys reopen"):
        admin.reopen(ops, other)

    assert admin.reopen(ops, key_id).changed == (key_id,)

    row = key(ops.db, key_id)
    assert (row.finished_at, row.abandoned_at, row.response_status, row.attempts) == (
        None, None, None, 0
    )  # fmt: skip
    assert Completer(steps).run_once().finished == 1
    assert key(ops.db, key_id).response_status == 201


@pytest.mark.slow
def test_delete_removes_finished_keys_unlinks_their_jobs_and_refuses_unfinished_ones(
    ops: admin.Admin, steps: rp.Engine
) -> None:
    steps.run(steps.operation("steps", 1), key="k", params={})
    [done] = [r.id for r in rows(ops.db, "SELECT id FROM idempotency_keys")]
    [unfinished] = plant(ops.db, **OVERDUE)

    assert admin.delete(ops, done).changed == (done,)
    assert rows(ops.db, "SELECT idempotency_key_id FROM staged_jobs") == [(None,)]
    with pytest.raises(admin.Refused, match="abandon it instead, or pass --force"):
        admin.delete(ops, unfinished)
    assert admin.delete(ops, unfinished, force=True).changed == (unfinished,)
    assert rows(ops.db, "SELECT id FROM idempotency_keys") == []


@pytest.mark.slow
def test_purge_deletes_keys_finished_before_the_time(ops: admin.Admin) -> None:
    old = plant(ops.db, count=3, finished_at="now() - interval '4 days'", response_status="200")
    [old_abandoned] = plant(ops.db, **{**ABANDONED, "finished_at": "now() - interval '4 days'"})
    recent = plant(ops.db, **FINISHED)
    unfinished = plant(ops.db, created_at="now() - interval '9 days'", **OVERDUE)

    dry = admin.purge(ops, timedelta(days=3), dry_run=True)
    assert dry.matched == 3 and {r.id for r in dry.sample} == set(old)
    result = admin.purge(ops, timedelta(days=3), batch_size=2)
    assert sorted(result.changed) == old
    assert admin.purge(ops, timedelta(days=3), include_abandoned=True).changed == (old_abandoned,)
    remaining = sorted(r.id for r in rows(ops.db, "SELECT id FROM idempotency_keys"))
    assert remaining == sorted(recent + unfinished)


@pytest.mark.slow
def test_purge_goes_through_every_scope_a_page_at_a_time(ops: admin.Admin) -> None:
    """Purge acts scope by scope (on Citus, one shard per statement): scopes are read in
    pages of ``batch_size``, and each scope's keys in batches of it."""
    old = plant(ops.db, count=10, finished_at="now() - interval '4 days'", response_status="200")
    with ops.db.begin() as conn:  # five scopes of two keys: three pages of scopes
        conn.execute(
            sa.text("UPDATE idempotency_keys SET scope = 'tenant-' || (id % 5) WHERE id = ANY(:i)"),
            {"i": old},
        )
    result = admin.purge(ops, timedelta(days=3), batch_size=2)
    assert sorted(result.changed) == old
    assert rows(ops.db, "SELECT id FROM idempotency_keys") == []


@pytest.mark.slow
def test_every_action_is_logged_with_who_what_and_which(
    ops: admin.Admin, caplog: pytest.LogCaptureFixture
) -> None:
    [key_id] = plant(ops.db, **EXPIRED)
    with caplog.at_level(logging.INFO, logger="recoverypoint.admin"):
        admin.release(ops, key_id)
        admin.retry(ops, admin.KeyFilter(ids=(key_id,)), dry_run=True)  # not logged
    [line] = [r.getMessage() for r in caplog.records if r.name == "recoverypoint.admin"]
    assert line == (
        f"event=keys.release actor=tester@test changed=1 ids={key_id} matched=1 force=False"
    )


@pytest.mark.slow
def test_an_action_waits_for_a_running_phase_then_refuses(ops: admin.Admin) -> None:
    [key_id] = plant(ops.db, **EXPIRED)
    quick = dataclasses.replace(ops, lock_wait=0.2)
    with ops.db.connect() as phase:
        phase.execute(sa.text("SELECT 1 FROM idempotency_keys WHERE id = :i FOR UPDATE"),
                      {"i": key_id})  # fmt: skip
        with pytest.raises(admin.Refused, match="running phase"):
            admin.release(quick, key_id)
        phase.rollback()
    assert admin.release(quick, key_id).changed == (key_id,)


# -- release --force racing a running phase ------------------------------------------------


@pytest.mark.slow
def test_a_forced_release_racing_a_running_phase_never_charges_twice(
    engine: rp.Engine, provider: Any, faults: Any, scope: str, db: sa.Engine
) -> None:
    """The first request is blocked after the provider charged; an operator force-releases
    its lease; a retry takes the key over, charges again with the same downstream key
    (the provider dedupes it) and finishes; the first request's next commit is LockLost."""
    from rides import ride_operation

    operation = ride_operation(f"ride_{uuid.uuid4().hex[:8]}", provider, faults)
    engine.register(operation)
    charged, resume = threading.Event(), threading.Event()
    calls = [0]

    def block_first_after_charge() -> None:
        calls[0] += 1
        if calls[0] == 1:
            charged.set()
            assert resume.wait(30)

    faults.hooks["charge_created:after_call"] = block_first_after_charge
    params = {"scope": scope}
    first: list[BaseException | rp.Outcome] = []

    def run_first() -> None:
        try:
            first.append(engine.run(operation, key="ride-1", scope=scope, params=params))
        except BaseException as exc:
            first.append(exc)

    thread = threading.Thread(target=run_first)
    thread.start()
    assert charged.wait(30)
    ops = admin.Admin.for_engine(engine)
    [key_id] = [r.id for r in rows(db, "SELECT id FROM idempotency_keys WHERE scope = :s",
                                   s=scope)]  # fmt: skip
    with pytest.raises(admin.Refused, match="live lease"):
        admin.release(ops, key_id)

    assert admin.release(ops, key_id, force=True).changed == (key_id,)
    second = engine.run(operation, key="ride-1", scope=scope, params=params)
    resume.set()
    thread.join(30)

    assert second.status == 201 and not second.replayed
    assert len(first) == 1 and isinstance(first[0], rp.LockLost)
    downstream = [k for k in provider.keys_seen]
    assert len(downstream) == 2 and len(set(downstream)) == 1  # the step ran twice...
    charges = rows(db, "SELECT downstream_key FROM provider_charges WHERE scope = :s", s=scope)
    assert [c.downstream_key for c in charges] == downstream[:1]  # ...and charged once
    assert rows(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == [(1,)]
    detail = admin.find_key(ops, key_id)
    assert detail.row.state == "finished"
    [step] = [p for p in detail.phases if p.kind == "foreign"]
    assert step.downstream_key == downstream[0]


def test_every_state_the_database_decides_is_a_documented_key_state() -> None:
    decided = set(re.findall(r"'([a-z-]+)'", admin_sql.STATE))
    assert decided == {state.value for state in admin.KeyState} == set(admin.STATES)
    assert f"{admin.KeyState.IN_FLIGHT}" == admin.IN_FLIGHT == "in-flight"
