"""The completer on real PostgreSQL: what it claims, backoff, abandonment, keys it must not
touch, and three completer processes sharing 1,000 keys."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from workload import PHASES, Recorder, plant_keys, rows, steps_operation

import recoverypoint as rp
from recoverypoint.workers import ABANDONED_RESPONSE, Completer, loop

TESTS = Path(__file__).resolve().parent
ACCEPTED = rp.Request("POST", "/test")
OLD = "now() - interval '1 day'"


def make_engine(db: sa.Engine, *, retry_base: float = 2.0, **options: Any) -> rp.Engine:
    engine = rp.Engine(db, retry_base=retry_base)
    engine.register(steps_operation("steps", Recorder(db), **options))
    return engine


def key(db: sa.Engine, key_id: int) -> Any:
    return rows(
        db,
        "SELECT *, next_attempt_at - now() AS due_in FROM idempotency_keys WHERE id = :i",
        i=key_id,
    )[0]


def make_due(db: sa.Engine, key_id: int) -> None:
    """Move a key's next attempt into the past, as waiting out its backoff would."""
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET next_attempt_at = now() WHERE id = :i"),
            {"i": key_id},
        )


def test_resumes_a_key_its_client_left_and_it_replays_after(worker_db: sa.Engine) -> None:
    engine = make_engine(worker_db)
    [key_id] = plant_keys(worker_db, "steps", 1, point="reserved")

    result = Completer(engine, min_age=0).run_once()

    assert (result.finished, result.failed, result.abandoned) == (1, 0, 0)
    row = key(worker_db, key_id)
    assert (row.recovery_point, row.response_status, row.lock_token) == ("finished", 201, None)
    # It resumed after "reserved": that phase did not run again.
    assert [r.phase for r in rows(worker_db, "SELECT phase FROM phase_runs")] == ["finished"]
    assert Completer(engine, min_age=0).run_once().finished == 0


def test_engine_resume_says_why_it_cannot_resume_a_key(worker_db: sa.Engine) -> None:
    engine = make_engine(worker_db)
    [finished] = plant_keys(
        worker_db, "steps", 1, point="finished", response_status="202", finished_at="now()"
    )
    [leased] = plant_keys(worker_db, "steps", 1, locked_at="now()", lock_token="gen_random_uuid()")
    [ghost] = plant_keys(worker_db, "ghost", 1)

    assert engine.resume(finished) == rp.Outcome(202, None, {}, replayed=True)
    with pytest.raises(rp.KeyInUse) as in_use:
        engine.resume(leased)
    assert 85 <= in_use.value.retry_after <= 90  # what is left of the 90 s lease
    with pytest.raises(rp.OperationNotRegistered, match="'ghost' v1"):
        engine.resume(ghost)
    with pytest.raises(LookupError):
        engine.resume(10**12)
    assert rows(worker_db, "SELECT * FROM phase_runs") == []


def test_claims_only_due_keys_whose_client_had_time_and_whose_lease_is_free(
    worker_db: sa.Engine,
) -> None:
    engine = make_engine(worker_db)
    old = "now() - interval '1 hour'"
    [recent] = plant_keys(worker_db, "steps", 1)  # last_run_at: now
    [backing_off] = plant_keys(
        worker_db, "steps", 1, last_run_at=old, next_attempt_at="now() + interval '1 hour'"
    )
    [leased] = plant_keys(
        worker_db, "steps", 1, last_run_at=old, locked_at="now()", lock_token="gen_random_uuid()"
    )
    [expired] = plant_keys(
        worker_db, "steps", 1, last_run_at=old, locked_at=old, lock_token="gen_random_uuid()"
    )
    [idle] = plant_keys(worker_db, "steps", 1, last_run_at=old)

    assert Completer(engine, min_age=60).run_once().finished == 2
    assert {
        k for k in (recent, backing_off, leased, expired, idle) if key(worker_db, k).finished_at
    } == {
        expired,
        idle,
    }
    # --min-age 0: a key is taken as soon as it is due, however recent its last run.
    assert Completer(engine, min_age=0).run_once().finished == 1
    assert key(worker_db, recent).response_status == 201
    assert key(worker_db, backing_off).finished_at is None
    assert key(worker_db, leased).finished_at is None


def test_an_operators_retry_is_taken_by_the_next_pass_whatever_its_min_age(
    worker_db: sa.Engine,
) -> None:
    engine = make_engine(worker_db)
    ops = rp.admin.Admin(worker_db, actor="tester@test")
    # Two keys whose clients just failed (last run: now), one of them about to fail again.
    [retried, left] = plant_keys(worker_db, "steps", 2)
    [failing] = plant_keys(worker_db, "steps", 1, params={"fail": "charged"})
    completer = Completer(engine, min_age=3600)
    assert not completer.run_once()  # their clients have the hour to come back

    assert rp.admin.retry(ops, retried).changed == (retried,)
    assert rp.admin.retry(ops, failing).changed == (failing,)
    result = completer.run_once()

    assert (result.finished, result.failed, result.too_recent) == (1, 1, 1)
    assert key(worker_db, retried).response_status == 201
    assert key(worker_db, left).attempts == 0  # its client's to retry: not taken
    # The retry made one attempt due, not every later one: failed again, the key waits
    # for its client as any key does, once its backoff is over too.
    make_due(worker_db, failing)
    assert not completer.run_once()
    assert key(worker_db, failing).attempts == 1


def test_backs_off_per_key_then_abandons_with_a_replayed_error_and_one_log_line(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(worker_db, retry_base=10.0, max_attempts=3)
    op = engine.operation("steps", 1)
    params = {"fail": "charged"}

    # The client's own attempt fails at the foreign step and backs off 5 to 10 s.
    with pytest.raises(RuntimeError):
        engine.run(op, key="k1", params=params, request=ACCEPTED)
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
    first = key(worker_db, key_id)
    assert first.attempts == 1
    assert timedelta(seconds=4) < first.due_in <= timedelta(seconds=10)

    completer = Completer(engine, min_age=0)
    assert not completer.run_once()  # not due yet: left alone
    assert key(worker_db, key_id).attempts == 1

    make_due(worker_db, key_id)
    result = completer.run_once()
    assert (result.failed, result.abandoned) == (1, 0)  # attempts left: not abandoned
    second = key(worker_db, key_id)
    assert second.attempts == 2
    assert second.lock_token is None
    assert timedelta(seconds=9) < second.due_in <= timedelta(seconds=20)  # doubled

    make_due(worker_db, key_id)
    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        result = completer.run_once()

    assert (result.failed, result.abandoned) == (1, 1)
    row = key(worker_db, key_id)
    assert row.attempts == 3
    assert row.finished_at is not None and row.abandoned_at is not None
    assert row.recovery_point == "reserved"  # where it stopped, for whoever looks into it
    assert (row.response_status, row.response_body) == (
        ABANDONED_RESPONSE.status,
        ABANDONED_RESPONSE.body,
    )
    [line] = [r.getMessage() for r in caplog.records if "event=abandoned" in r.getMessage()]
    assert f"key_id={key_id} " in line
    assert "operation=steps version=1 " in line
    assert "idempotency_key=k1 " in line
    assert "recovery_point=reserved attempts=3 " in line
    assert 'last_error="RuntimeError: card network down"' in line

    # A client that retries gets the stored error; nothing runs again.
    calls = len(rows(worker_db, "SELECT * FROM step_calls"))
    outcome = engine.run(op, key="k1", params=params, request=ACCEPTED)
    assert (outcome.status, outcome.replayed) == (ABANDONED_RESPONSE.status, True)
    assert len(rows(worker_db, "SELECT * FROM step_calls")) == calls == 3
    make_due(worker_db, key_id)
    assert not completer.run_once()


def test_the_backoff_of_a_key_never_exceeds_the_engines_retry_cap(worker_db: sa.Engine) -> None:
    engine = rp.Engine(worker_db, retry_base=1.0, retry_cap=5.0)
    engine.register(steps_operation("steps", Recorder(worker_db), max_attempts=100))
    failing = {"params": {"fail": "charged"}}
    [key_id] = plant_keys(worker_db, "steps", 1, **failing)
    # One that failed so often that the uncapped delay would be out of any range.
    [veteran] = plant_keys(worker_db, "steps", 1, attempts="80", **failing)
    completer = Completer(engine, min_age=0)

    def between(low: float, high: float, row: Any, before: datetime) -> bool:
        """Whether the backoff the pass gave ``row`` may lie in (low, high] s. The pass ran
        between ``before`` and the row's reading: the backoff is at least the next attempt's
        distance from the reading (``due_in``), at most its distance from ``before``."""
        longest = row.next_attempt_at - before
        return longest > timedelta(seconds=low) and row.due_in <= timedelta(seconds=high)

    waits = []
    for attempt in range(1, 8):
        make_due(worker_db, key_id)
        make_due(worker_db, veteran)
        [(before,)] = rows(worker_db, "SELECT now()")
        assert completer.run_once().failed == 2
        row, old = key(worker_db, key_id), key(worker_db, veteran)
        assert (row.attempts, old.attempts) == (attempt, 80 + attempt)
        assert between(2.4, 5, old, before)
        waits.append((row, before))

    # 1, 2, 4 s (half of it fixed, half jittered), then the cap of 5 s every time.
    assert between(0.4, 1, *waits[0])
    assert all(between(2.4, 5, *wait) for wait in waits[3:])


def test_keys_out_of_attempts_are_abandoned_without_another_run(worker_db: sa.Engine) -> None:
    engine = make_engine(worker_db, max_attempts=2)
    ids = plant_keys(worker_db, "steps", 2, attempts="2", last_error="'Boom'")

    result = Completer(engine, min_age=0, batch_size=1).run_once()

    assert (result.abandoned, result.failed, result.finished) == (2, 0, 0)
    assert result.batches == 3  # one key a batch, then an empty one
    assert all(key(worker_db, key_id).abandoned_at is not None for key_id in ids)
    assert rows(worker_db, "SELECT * FROM step_calls") == []


def test_keys_their_clients_took_between_the_claim_and_the_resume_are_skipped(
    worker_db: sa.Engine,
) -> None:
    """While the completer runs the first key of its batch, a client finishes the second
    and takes over the third (as if their leases had expired): the completer leaves both
    to their clients."""
    engine = rp.Engine(worker_db)
    [first] = plant_keys(worker_db, "steps", 1, next_attempt_at=OLD)  # the batch's first
    finished, taken = plant_keys(worker_db, "steps", 2)
    client_token = "11111111-1111-1111-1111-111111111111"

    def clients_meanwhile() -> None:
        with worker_db.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET finished_at = now(), response_status = 202, "
                    "recovery_point = 'finished', locked_at = NULL, lock_token = NULL "
                    "WHERE id = :f AND finished_at IS NULL"
                ),
                {"f": finished},
            )
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET locked_at = now(), lock_token = :t WHERE id = :i"
                ),
                {"t": client_token, "i": taken},
            )

    engine.register(steps_operation("steps", Recorder(worker_db, on_step=clients_meanwhile)))

    result = Completer(engine, min_age=0).run_once()

    assert (result.finished, result.skipped, result.failed, result.errors) == (1, 2, 0, 0)
    assert key(worker_db, first).response_status == 201
    assert key(worker_db, finished).response_status == 202  # the client's answer stands
    assert str(key(worker_db, taken).lock_token) == client_token  # the client's lease stands
    calls = rows(worker_db, "SELECT key_id FROM step_calls")
    assert [c.key_id for c in calls] == [first]


def test_a_stop_shared_with_other_workers_stops_the_completer(worker_db: sa.Engine) -> None:
    stop = threading.Event()
    completer = Completer(make_engine(worker_db), min_age=0, stop_event=stop)
    plant_keys(worker_db, "steps", 2)

    stop.set()

    assert completer.stopping and not completer.run_once()
    assert rows(worker_db, "SELECT * FROM idempotency_keys WHERE finished_at IS NOT NULL") == []


def test_keys_of_unregistered_operations_or_versions_are_reported_and_never_touched(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(worker_db)  # registers "steps" v1 only
    old = {"last_run_at": "now() - interval '1 day'"}
    planted = [
        *plant_keys(worker_db, "ghost", 2, **old),
        *plant_keys(worker_db, "steps", 1, version=2, **old),
        *plant_keys(worker_db, "ghost", 1, locked_at="now() - interval '1 day'", **old),
    ]
    # xmin changes with any update, xmax with any row lock: together they catch a touch.
    snapshot = "SELECT xmin::text, xmax::text, k.* FROM idempotency_keys k ORDER BY id"
    before = rows(worker_db, snapshot)

    with caplog.at_level(logging.WARNING, logger="recoverypoint.workers"):
        completer = Completer(engine, min_age=0)
        result = completer.run_once()
        completer.run_once()

    # No running completer registers them: no worker can finish them (tests/test_unfinishable.py).
    assert result.unregistered == result.unfinishable == len(planted) == 4
    assert (result.finished, result.failed, result.abandoned, result.skipped) == (0, 0, 0, 0)
    assert rows(worker_db, snapshot) == before
    errors = sorted(
        r.getMessage() for r in caplog.records if "event=unfinishable" in r.getMessage()
    )
    # Reported once, not on every pass, per operation and version.
    assert len(errors) == 2
    assert "operation=ghost version=1 keys=3" in errors[0]
    assert "operation=steps version=2 keys=1" in errors[1]


def test_a_stop_mid_batch_finishes_the_current_key_and_hands_back_the_rest(
    worker_db: sa.Engine,
) -> None:
    engine = rp.Engine(worker_db)
    completer = Completer(engine, min_age=0, batch_size=5)
    # The first key's foreign step asks the completer to stop, as SIGTERM would.
    engine.register(steps_operation("steps", Recorder(worker_db, on_step=completer.stop)))
    ids = plant_keys(worker_db, "steps", 5)

    result = completer.run_once()

    assert (result.finished, result.batches) == (1, 1)
    states = rows(
        worker_db,
        "SELECT count(*) FILTER (WHERE finished_at IS NOT NULL) AS finished, "
        "count(*) FILTER (WHERE lock_token IS NOT NULL) AS leased, sum(attempts) AS attempts "
        "FROM idempotency_keys WHERE id = ANY(:ids)",
        ids=ids,
    )[0]
    # One attempt, the resumed key's, counted at its claim; the keys handed back count none.
    assert (states.finished, states.leased, states.attempts) == (1, 0, 1)


def test_a_pass_ends_after_its_most_batches_and_the_next_goes_on(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys falling due as fast as batches take them cannot keep one pass running: it ends
    after its most full batches of keys, and the next pass goes on."""
    monkeypatch.setattr(loop, "BATCHES_PER_PASS", 2)
    engine = make_engine(worker_db)
    plant_keys(worker_db, "steps", 9, last_run_at=OLD)
    completer = Completer(engine, min_age=0, batch_size=2)

    passes = [completer.run_once() for _ in range(4)]

    assert [(p.finished, p.batches) for p in passes] == [(4, 2), (4, 2), (1, 1), (0, 1)]


class InOrder(Recorder):
    """Records too the order the keys' steps are called in, which is the order of resume."""

    def __init__(self, db: sa.Engine) -> None:
        super().__init__(db)
        self.order: list[int] = []

    def step_called(self, key_id: int) -> None:
        self.order.append(key_id)
        super().step_called(key_id)


@pytest.mark.parametrize("distributed", [False, True], ids=["one server", "by scope"])
def test_keys_of_every_scope_are_resumed_however_many_scopes_have_keys(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch, distributed: bool
) -> None:
    """On one server a batch reserves due keys of every scope, longest due first across
    them: keys left in more scopes than a listing names (here 3) are finished in one pass.
    Scope by scope (as on Citus, where each claim names its scope) it takes a pass per
    listing, and finishes the same. Either way each key is reserved and resumed in its own
    scope, once: not another scope's row of the same id (not due), nor another scope's key
    that is not due, nor one whose lease is held."""
    monkeypatch.setattr(loop, "SCOPES_PER_PASS", 3)
    recorder = InOrder(worker_db)
    engine = rp.Engine(worker_db, retry_base=2.0)
    engine.register(steps_operation("steps", recorder))
    left = plant_keys(worker_db, "steps", 20, last_run_at=OLD)
    [later] = plant_keys(worker_db, "steps", 1, next_attempt_at="now() + interval '1 hour'")
    [held] = plant_keys(worker_db, "steps", 1, locked_at="now()", lock_token="gen_random_uuid()")
    with worker_db.begin() as conn:
        # Two keys in each of 10 scopes, each due a second before the one planted before
        # it: the last planted is the longest due. The other two keys go to s1 and s2.
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET scope = 's' || (1 + (id - :first) % 10), "
                "next_attempt_at = next_attempt_at - make_interval(secs => id - :first) "
                "WHERE id = ANY(:ids)"
            ),
            {"first": left[0], "ids": [*left, later, held]},
        )
        # Another scope's key with the first key's id, not due: the same id, another row.
        conn.execute(
            sa.text(
                "INSERT INTO idempotency_keys (id, scope, operation, idempotency_key, "
                "operation_version, request_method, request_path, request_params, "
                "fingerprint, recovery_point, last_run_at, next_attempt_at) "
                "OVERRIDING SYSTEM VALUE VALUES (:id, 'twin', 'steps', 'twin', 1, 'POST', "
                f"'/test', '{{}}', 'fp', 'started', {OLD}, now() + interval '1 hour')"
            ),
            {"id": left[0]},
        )
    completer = Completer(engine, min_age=0, batch_size=7)
    completer.distributed = distributed

    passes = [completer.run_once()]
    while passes[-1].finished:
        passes.append(completer.run_once())

    # One server: batches of 7, 7 and 6, then a pass with none. By scope: 3 scopes a pass.
    assert [p.finished for p in passes] == ([20, 0] if not distributed else [6, 6, 6, 2, 0])
    finished = rows(
        worker_db,
        "SELECT id, scope, response_status, attempts FROM idempotency_keys "
        "WHERE finished_at IS NOT NULL ORDER BY id",
    )
    assert [(r.id, r.scope, r.response_status, r.attempts) for r in finished] == [
        (key_id, f"s{1 + (key_id - left[0]) % 10}", 201, 1) for key_id in left
    ]
    runs = rows(worker_db, "SELECT key_id, phase FROM phase_runs ORDER BY key_id, phase")
    assert [(r.key_id, r.phase) for r in runs] == [
        (key_id, phase) for key_id in left for phase in ("finished", "reserved")
    ]
    calls = rows(worker_db, "SELECT key_id FROM step_calls ORDER BY key_id")
    assert [r.key_id for r in calls] == left  # the foreign step, once each
    if not distributed:
        assert recorder.order == left[::-1]  # the longest due first, whatever its scope
    untouched = rows(
        worker_db,
        "SELECT id, scope, attempts, lock_token, finished_at FROM idempotency_keys "
        "WHERE id = ANY(:ids) AND NOT (id = :first AND scope = 's1') ORDER BY id",
        ids=[left[0], later, held],
        first=left[0],
    )
    assert [(r.id, r.scope, r.attempts, r.finished_at) for r in untouched] == [
        (left[0], "twin", 0, None),
        (later, "s1", 0, None),
        (held, "s2", 0, None),
    ]
    assert untouched[0].lock_token is None  # the twin was not reserved either


@pytest.mark.slow
def test_three_completer_processes_finish_1000_keys_each_once(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    # Keys as crashed or gone clients leave them: never started, halfway, lease expired.
    old = "now() - interval '1 hour'"
    plant_keys(worker_db, "steps", 400, last_run_at=old)
    plant_keys(worker_db, "steps", 300, point="reserved", last_run_at=old)
    plant_keys(
        worker_db, "steps", 300, last_run_at=old, locked_at=old, lock_token="gen_random_uuid()"
    )
    env = {**os.environ, "RP_WORKER_TEST_DATABASE_URL": worker_database_url}
    command = [
        sys.executable, "-m", "recoverypoint", "worker", "completer", "--app", "worker_app:engine",
        "--once", "--min-age", "0", "--batch-size", "10",
    ]  # fmt: skip
    processes = [
        subprocess.Popen(command, cwd=TESTS, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [process.communicate(timeout=120)[1] for process in processes]

    assert [p.returncode for p in processes] == [0, 0, 0], errors
    finished = rows(
        worker_db,
        "SELECT count(*) FILTER (WHERE response_status = 201) AS ok, count(*) AS all "
        "FROM idempotency_keys",
    )[0]
    assert (finished.ok, finished.all) == (1000, 1000)
    # Every phase body ran once per key: the atomic ones committed once, and the foreign
    # step was called once, by whichever process took the key.
    per_phase = {
        r.phase: (r.keys, r.runs)
        for r in rows(
            worker_db,
            "SELECT phase, count(DISTINCT key_id) AS keys, count(*) AS runs FROM phase_runs "
            "GROUP BY phase UNION ALL SELECT 'charged', count(DISTINCT key_id), count(*) "
            "FROM step_calls",
        )
    }
    assert per_phase == {"reserved": (700, 700), "charged": (1000, 1000), "finished": (1000, 1000)}
    assert set(per_phase) == set(PHASES)
    # The processes' own counts add up, and no process found a key another one had claimed.
    totals = {"finished": 0, "skipped": 0}
    for line in (line for error in errors for line in error.splitlines()):
        if "event=pass" in line:
            fields = dict(pair.split("=", 1) for pair in line.split() if "=" in pair)
            for name in totals:
                totals[name] += int(fields[name])
    assert totals == {"finished": 1000, "skipped": 0}, errors


# -- one operation, or one key, never stalls the others ------------------------------------


def completer_log(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"event={event} " in r.getMessage()]


def test_an_operation_whose_claim_fails_sits_the_pass_out_and_the_others_complete(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # An operation whose claim the database refuses. Declarations now refuse a lock timeout
    # SQL cannot add (timedelta.max); one set on the object afterwards still gets through,
    # and stands for any failure of one operation's claim: `now() - lock_timeout` is out of
    # PostgreSQL's range for a leased key of it.
    engine = make_engine(worker_db)
    forever = steps_operation("forever", Recorder(worker_db))
    forever.lock_timeout = timedelta.max
    engine.register(forever)
    leased = plant_keys(
        worker_db,
        "forever",
        2,
        last_run_at=OLD,
        next_attempt_at=OLD,  # due first: the combined claim meets them whatever the plan
        locked_at=OLD,
        lock_token="gen_random_uuid()",
    )
    ids = plant_keys(worker_db, "steps", 5)
    snapshot = "SELECT xmin::text, k.* FROM idempotency_keys k WHERE id = ANY(:ids) ORDER BY id"
    before = rows(worker_db, snapshot, ids=leased)

    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        result = Completer(engine, min_age=0, batch_size=2).run_once()

    assert (result.finished, result.failed, result.errors) == (5, 0, 1)
    done = rows(worker_db, "SELECT count(*) FROM idempotency_keys WHERE response_status = 201")
    assert done[0][0] == 5
    assert len(rows(worker_db, "SELECT * FROM step_calls WHERE key_id = ANY(:i)", i=ids)) == 5
    assert rows(worker_db, snapshot, ids=leased) == before  # never touched
    [line] = completer_log(caplog, "claim_failed")
    assert "worker=completer operation=forever version=1 " in line
    assert "timestamp out of range" in line


def test_a_key_that_cannot_be_abandoned_does_not_stall_the_others(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(worker_db)
    engine.register(steps_operation("doomed", Recorder(worker_db), max_attempts=1))
    with worker_db.begin() as conn:
        # A database error of that operation's keys alone, when they are abandoned.
        conn.exec_driver_sql(
            """
            CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'doomed keys may not be abandoned'; END $$;
            CREATE TRIGGER refuse_abandon BEFORE UPDATE ON idempotency_keys FOR EACH ROW
                WHEN (NEW.abandoned_at IS NOT NULL AND NEW.operation = 'doomed')
                EXECUTE FUNCTION refuse();
            """
        )
    # Out of attempts and due first: the first keys of the batch, every pass.
    doomed = plant_keys(worker_db, "doomed", 2, attempts="1", next_attempt_at=OLD)
    ids = plant_keys(worker_db, "steps", 4)
    completer = Completer(engine, min_age=0)

    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        result = completer.run_once()

    assert (result.finished, result.abandoned, result.errors) == (4, 0, 2)
    finished = rows(
        worker_db, "SELECT id FROM idempotency_keys WHERE response_status = 201 ORDER BY id"
    )
    assert [r.id for r in finished] == ids
    assert rows(worker_db, "SELECT * FROM step_calls WHERE key_id = ANY(:i)", i=doomed) == []
    lines = completer_log(caplog, "key_failed")
    assert len(lines) == 2
    for key_id in doomed:
        [line] = [line for line in lines if f" key_id={key_id} " in line]
        assert "operation=doomed version=1 " in line
        assert "doomed keys may not be abandoned" in line
    # They keep the pass's lease, so they are not tried again on every pass.
    leased = rows(worker_db, "SELECT lock_token FROM idempotency_keys WHERE id = ANY(:i)", i=doomed)
    assert all(r.lock_token is not None for r in leased)
    assert not completer.run_once()
