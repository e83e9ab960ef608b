"""A poison key: a request whose phase kills its process (``os._exit``, SIGKILL). Its
attempts count when they are claimed, so it is backed off and abandoned after the
operation's ``max_attempts``, whether its clients or the completer keep retrying it, and the
completer's batch goes on without it. Every client request and every completer pass runs in
a child process (tests/poison_child.py) that the poison phase kills."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
import uuid
from typing import Any

import poison_child
import pytest
import sqlalchemy as sa
from poison_child import DIED, LOCK_TIMEOUT, MAX_ATTEMPTS, SCOPE, engine_with
from workload import plant_keys

import recoverypoint as rp
from recoverypoint.testing import Clock
from recoverypoint.workers import ABANDONED_RESPONSE, Completer

pytestmark = pytest.mark.slow  # processes killed again and again

KINDS = ["step", "phase", "kill"]

# Past a dead holder's lease (LOCK_TIMEOUT) and the poison key's back-off (retry_base 2 s,
# three attempts), past a completer's reservation, yet within the healthy operation's
# default lock timeout (90 s): time moves this much between two processes.
LATER = max(LOCK_TIMEOUT.total_seconds(), Completer.reservation) + 15


def pass_time(db: sa.Engine, seconds: float) -> None:
    """As if ``seconds`` had passed: every stored moment of the test's database moves back."""
    Clock(db).advance(seconds=seconds)


def calls(db: sa.Engine, key_ids: list[int]) -> int:
    """Calls of the keys' steps, as the provider recorded them (a killed run's too)."""
    with db.connect() as conn:
        query = "SELECT count(*) FROM step_calls WHERE key_id = ANY(:ids)"
        return int(conn.execute(sa.text(query), {"ids": key_ids}).scalar_one())


def key_row(db: sa.Engine, key: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT id, attempts, abandoned_at, finished_at, response_status, "
                "next_attempt_at > now() AS backing_off "
                "FROM idempotency_keys WHERE idempotency_key = :key"
            ),
            {"key": key},
        ).one()


# Each child is forked from a server process that has imported recoverypoint: a fresh
# interpreter per child spent 40 times more on its imports than on its request. (Not
# poison_child itself: a server on Python 3.13.0 imports with the tests' directory off its
# path, and skips what it cannot import; each child imports that small module.)
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["recoverypoint", "recoverypoint.workers", "recoverypoint.testing"])


def run_child(db: sa.Engine, url: str, *args: str) -> tuple[int, str]:
    """Run poison_child.py with ``args``; a ``kill`` child is SIGKILLed from here once its
    poison phase has recorded its call. Its exit status, and its output: the last line the
    answer it printed, the logs before it."""
    with tempfile.NamedTemporaryFile("r", suffix=".out") as output:
        process = FORKS.Process(target=poison_child.forked, args=([url, *args], output.name))
        process.start()
        if args[2] == "kill":
            deadline = time.monotonic() + 60
            while process.is_alive() and not poison_called(db, process.pid):
                assert time.monotonic() < deadline, "the poison phase never ran"
                time.sleep(0.02)  # waits for the call's row to appear
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        process.join(timeout=120)
        assert process.exitcode is not None, "the child did not end within 120 s"
        return process.exitcode, output.read()


def poison_called(db: sa.Engine, pid: int) -> bool:
    """Whether process ``pid`` called the poison phase (not a healthy key's step)."""
    query = """
        SELECT EXISTS (SELECT FROM step_calls AS c JOIN idempotency_keys AS k ON k.id = c.key_id
                       WHERE c.pid = :pid AND k.operation LIKE 'poison%')
    """
    with db.connect() as conn:
        return bool(conn.execute(sa.text(query), {"pid": pid}).scalar_one())


def unfinished(db: sa.Engine, key_ids: list[int]) -> int:
    with db.connect() as conn:
        query = "SELECT count(*) FROM idempotency_keys WHERE id = ANY(:ids) AND finished_at IS NULL"
        return int(conn.execute(sa.text(query), {"ids": key_ids}).scalar_one())


def healthy_attempts(db: sa.Engine, key_ids: list[int]) -> list[int]:
    with db.connect() as conn:
        query = "SELECT attempts FROM idempotency_keys WHERE id = ANY(:ids) ORDER BY id"
        return list(conn.execute(sa.text(query), {"ids": key_ids}).scalars())


def killed(status: int, kind: str) -> bool:
    return status == (-signal.SIGKILL if kind == "kill" else DIED)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_client_retries_of_a_poison_key_use_max_attempts_then_get_the_abandoned_answer(
    worker_db: sa.Engine, worker_database_url: str, flavour: str, kind: str
) -> None:
    key = uuid.uuid4().hex
    client = ("client", flavour, kind, key)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        status, output = run_child(worker_db, worker_database_url, *client)
        assert killed(status, kind), output
        row = key_row(worker_db, key)
        # Counted at the claim, in its own commit: the dead process used its attempt, and
        # the key is backed off.
        assert (row.attempts, calls(worker_db, [row.id])) == (attempt, attempt)
        assert row.backing_off and row.finished_at is None
        pass_time(worker_db, LATER)  # the dead process's lease runs out

    # The retry that would start attempt max_attempts + 1 abandons the key instead.
    status, output = run_child(worker_db, worker_database_url, *client)
    assert status == 0, output
    answer = json.loads(output.splitlines()[-1])
    assert answer == {
        "status": ABANDONED_RESPONSE.status,
        "body": ABANDONED_RESPONSE.body,
        "replayed": False,
    }
    row = key_row(worker_db, key)
    assert (row.attempts, calls(worker_db, [row.id])) == (MAX_ATTEMPTS, MAX_ATTEMPTS)
    assert row.abandoned_at is not None and row.response_status == ABANDONED_RESPONSE.status

    status, output = run_child(worker_db, worker_database_url, *client)
    assert status == 0, output
    assert json.loads(output.splitlines()[-1])["replayed"] is True
    assert calls(worker_db, [row.id]) == MAX_ATTEMPTS


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_completer_abandons_a_poison_key_and_finishes_the_rest_of_its_batch(
    worker_db: sa.Engine, worker_database_url: str, flavour: str, kind: str
) -> None:
    # A client's request dies (attempt 1); healthy keys wait in the same scope, due after it.
    key = uuid.uuid4().hex
    status, output = run_child(worker_db, worker_database_url, "client", flavour, kind, key)
    assert killed(status, kind), output
    poison = key_row(worker_db, key).id
    healthy = plant_keys(worker_db, "healthy", 4, next_attempt_at="now() - interval '59 minutes'")
    with worker_db.begin() as conn:  # first in the batch
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET next_attempt_at = now() - interval '1 hour' "
                "WHERE id = :id"
            ),
            {"id": poison},
        )
    pass_time(worker_db, LATER)

    completer = ("completer", flavour, kind)
    passes = 0
    while passes < 2 * MAX_ATTEMPTS + 1:
        passes += 1
        status, output = run_child(worker_db, worker_database_url, *completer)
        if passes == 1:
            # The poison key, its last holder dead, was resumed alone and first (an async
            # batch's other keys only after it) and killed the pass: the healthy keys were
            # reserved, never resumed, and count no attempt.
            assert killed(status, kind), output
            assert healthy_attempts(worker_db, healthy) == [0] * len(healthy)
        if passes == 2:
            # Their reservations ran out long before their lock timeout: the next pass
            # resumed them, before the poison key its claim had backed off.
            assert unfinished(worker_db, healthy) == 0
        if key_row(worker_db, key).abandoned_at is not None and unfinished(worker_db, healthy) == 0:
            break
        pass_time(worker_db, LATER)

    row = key_row(worker_db, key)
    assert row.abandoned_at is not None, output
    assert (row.attempts, calls(worker_db, [poison])) == (MAX_ATTEMPTS, MAX_ATTEMPTS)
    # Resumed longest due first: the poison key, backed off by the claim of the attempt that
    # killed the first pass, came after them in the second, which finished them; the third
    # pass abandoned the poison key. The healthy keys, allowed as few attempts as the poison
    # key, used one each: it cost them none.
    assert passes == MAX_ATTEMPTS
    assert unfinished(worker_db, healthy) == 0
    assert healthy_attempts(worker_db, healthy) == [1] * len(healthy)
    assert calls(worker_db, healthy) == len(healthy)

    # The key's client retries, and gets the abandoned answer replayed.
    engine, op = engine_with(worker_database_url, "sync", kind)
    assert isinstance(engine, rp.Engine)
    outcome = engine.run(op, key=key, params={}, scope=SCOPE)
    assert (outcome.status, outcome.body, outcome.replayed) == (
        ABANDONED_RESPONSE.status,
        ABANDONED_RESPONSE.body,
        True,
    )
    engine.dispose()


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("kind", ["step", "kill"])
def test_an_idempotent_function_that_kills_its_process_runs_max_attempts_times(
    worker_db: sa.Engine, worker_database_url: str, flavour: str, kind: str
) -> None:
    key = uuid.uuid4().hex
    caller = ("idempotent", flavour, kind, key)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        status, output = run_child(worker_db, worker_database_url, *caller)
        assert killed(status, kind), output
        row = key_row(worker_db, key)
        assert (row.attempts, calls(worker_db, [row.id])) == (attempt, attempt)
        pass_time(worker_db, LATER)

    for _ in range(2):  # abandoned by the first call, replayed to the second
        status, output = run_child(worker_db, worker_database_url, *caller)
        assert status == 0, output
        answer = json.loads(output.splitlines()[-1])
        assert ABANDONED_RESPONSE.body["message"] in answer["abandoned"]
    row = key_row(worker_db, key)
    assert row.abandoned_at is not None
    assert (row.attempts, calls(worker_db, [row.id])) == (MAX_ATTEMPTS, MAX_ATTEMPTS)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_first_atomic_phase_that_kills_its_process_leaves_nothing_and_runs_at_each_retry(
    worker_db: sa.Engine, worker_database_url: str, flavour: str
) -> None:
    # The first atomic phase shares the claim's transaction: its death rolls the claim back
    # with it, so there is no row to count an attempt on, and no limit to the retries.
    key = uuid.uuid4().hex
    client = ("client", flavour, "first", key)
    for run in range(1, MAX_ATTEMPTS + 2):
        status, output = run_child(worker_db, worker_database_url, *client)
        assert killed(status, "first"), output
        # No key row, nothing the phase wrote; only the probe shows it ran, once per retry.
        stored = [count_rows(worker_db, t) for t in ("idempotency_keys", "phase_runs")]
        assert (stored, count_rows(worker_db, "step_calls")) == ([0, 0], run)

    status, output = run_child(worker_db, worker_database_url, "completer", flavour, "first")
    assert status == 0, output
    result = json.loads(output.splitlines()[-1])
    assert result["batches"] == 1
    assert {result[n] for n in ("finished", "failed", "abandoned", "skipped", "errors")} == {0}
    assert count_rows(worker_db, "step_calls") == MAX_ATTEMPTS + 1  # the completer ran nothing


def count_rows(db: sa.Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
