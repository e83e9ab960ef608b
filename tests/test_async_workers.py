"""The workers serve an asyncio application: ``--app`` names its ``rp.AsyncEngine`` alone, the
completer resumes its keys through ``AsyncEngine.resume`` (a batch's keys at once) with the
same backoff and abandonment as sync ones, the enqueuer publishes the jobs its phases staged,
and an application with both engines runs one completer for both. On a real database."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import types
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_worker_cli import TESTS, worker
from workload import (
    JOB,
    Recorder,
    async_steps_operation,
    plant_keys,
    rows,
    stage_jobs,
    steps_operation,
    wait_for,
)

import recoverypoint as rp
from recoverypoint.cli import main, metrics
from recoverypoint.cli._app import UsageError, load_engines
from recoverypoint.database import DATABASE_URL_ENV
from recoverypoint.exits import EXIT_OK, EXIT_USAGE
from recoverypoint.jobs import InProcessBackend
from recoverypoint.testing import FAULT_EXIT_STATUS
from recoverypoint.workers import Completer, Enqueuer, Reaper

# ``async_worker_app``'s operations (its module reads the database URL at import, so the
# tests import it only in subprocesses).
ASYNC_OPERATION = "async_steps"
SYNC_OPERATION = "steps"
EFFECT = "RECOVERYPOINT_FAULT_EFFECT"


def time_passes(db: sa.Engine) -> None:
    """An hour goes by for every key: leases expire, backoffs run out, clients had their
    chance to come back."""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET locked_at = locked_at - interval '1 hour', "
                "next_attempt_at = next_attempt_at - interval '1 hour', "
                "last_run_at = last_run_at - interval '1 hour'"
            )
        )


def phase_runs(db: sa.Engine) -> dict[str, int]:
    found = rows(db, "SELECT phase, count(*) FROM phase_runs GROUP BY phase")
    return {phase: n for phase, n in found}


def step_calls(db: sa.Engine) -> int:
    return int(rows(db, "SELECT count(*) FROM step_calls")[0][0])


def run_worker(database_url: str, kind: str, *engines: str) -> str:
    """``recoverypoint worker KIND --once --min-age 0``, an ``--app`` for each of
    ``async_worker_app``'s ``engines``; its stderr, once it exited 0."""
    apps = [arg for name in engines for arg in ("--app", f"async_worker_app:{name}")]
    process = worker(kind, "--once", "--min-age", "0", *apps, database_url=database_url)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return stderr


@pytest.fixture
def async_engine(worker_database_url: str) -> Iterator[rp.AsyncEngine]:
    engine = rp.AsyncEngine(worker_database_url)
    yield engine
    asyncio.run(engine.dispose())


def client_call(engine: rp.AsyncEngine, call: Any) -> Any:
    """Await ``call`` as a client of the application would, on its own event loop, whose
    connections are closed with it."""

    async def main() -> Any:
        try:
            return await call
        finally:
            await engine.dispose()

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("client_env", "client_status", "calls"),
    [
        ({"RP_PROVIDER_DOWN": "1"}, 1, 2),
        (
            {"RECOVERYPOINT_FAULTS": "after_commit:reserved=1", **{EFFECT: "exit"}},
            FAULT_EXIT_STATUS,
            1,
        ),
    ],
    ids=["foreign_step_failed", "killed_between_phases"],
)
def test_an_async_request_its_client_left_mid_flow_is_finished_by_the_completer_command(
    worker_db: sa.Engine,
    worker_database_url: str,
    client_env: dict[str, str],
    client_status: int,
    calls: int,
) -> None:
    client = subprocess.run(
        [sys.executable, "async_worker_app.py", "ride-1"],
        cwd=TESTS,
        env={**os.environ, "RP_WORKER_TEST_DATABASE_URL": worker_database_url, **client_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert client.returncode == client_status, client.stderr
    left = rows(worker_db, "SELECT recovery_point, response_status FROM idempotency_keys")
    assert left == [("reserved", None)]
    time_passes(worker_db)  # the client never comes back

    stderr = run_worker(worker_database_url, "completer", "engine")

    assert "finished=1" in stderr
    done = "SELECT recovery_point, response_status, attempts FROM idempotency_keys"
    # The client's attempt and the completer's, each counted by its claim.
    assert rows(worker_db, done) == [("finished", 201, 2)]
    assert phase_runs(worker_db) == {"reserved": 1, "finished": 1}
    assert step_calls(worker_db) == calls  # the client's call, if it got that far, and one
    assert len(rows(worker_db, "SELECT 1 FROM staged_jobs")) == 1


@pytest.mark.slow
def test_all_three_workers_of_an_async_app_finish_its_keys_and_publish_each_job_once(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    keys = plant_keys(worker_db, ASYNC_OPERATION, 25, point="reserved")

    first = run_worker(worker_database_url, "all", "engine")
    second = run_worker(worker_database_url, "all", "engine")  # nothing left to publish

    assert "finished=25" in first and "published=25" in first
    assert "finished=0" in second and "published=0" in second
    finished = "SELECT count(*) FROM idempotency_keys WHERE response_status = 201"
    assert rows(worker_db, finished) == [(len(keys),)]
    published = rows(worker_db, "SELECT job_key, count(*) FROM published GROUP BY job_key")
    assert len(published) == len(keys) and {n for _, n in published} == {1}
    assert rows(worker_db, "SELECT count(*) FROM staged_jobs") == [(0,)]
    assert phase_runs(worker_db) == {"finished": len(keys)}


@pytest.mark.slow
def test_the_workers_of_an_application_with_both_engines_are_one_command(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    plant_keys(worker_db, ASYNC_OPERATION, 4, point="reserved")
    plant_keys(worker_db, SYNC_OPERATION, 3, point="reserved")

    stderr = run_worker(worker_database_url, "all", "sync_engine", "engine")

    assert "finished=7" in stderr and "published=7" in stderr
    by_operation = "SELECT operation, count(*) FROM idempotency_keys GROUP BY 1 ORDER BY 1"
    assert rows(worker_db, by_operation) == [(ASYNC_OPERATION, 4), (SYNC_OPERATION, 3)]
    finished = "SELECT count(*) FROM idempotency_keys WHERE response_status = 201"
    assert rows(worker_db, finished) == [(7,)]
    assert rows(worker_db, "SELECT count(*), count(DISTINCT job_key) FROM published") == [(7, 7)]


@pytest.mark.slow
def test_the_completer_resumes_a_batch_of_async_keys_at_once(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine
) -> None:
    batch = 6
    entered = 0
    all_in = asyncio.Event()

    async def barrier() -> None:
        # Every key of the batch must be in its foreign step before any goes on: one key
        # after another, the first would wait here alone and fail.
        nonlocal entered
        entered += 1
        if entered == batch:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), timeout=20)

    recorder = Recorder(worker_db)
    async_engine.register(async_steps_operation("gated", recorder, gate=barrier))
    plant_keys(worker_db, "gated", batch)
    completer = Completer(async_engine, batch_size=batch, min_age=0)
    try:
        result = completer.run_once()
    finally:
        completer.close()

    assert (result.finished, result.failed, result.errors) == (batch, 0, 0)
    assert phase_runs(worker_db) == {"reserved": batch, "finished": batch}
    assert step_calls(worker_db) == batch


@pytest.mark.slow
def test_a_running_completer_closes_its_loop_as_it_stops(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine
) -> None:
    entered, release = threading.Event(), threading.Event()

    async def hold() -> None:
        entered.set()
        await asyncio.to_thread(release.wait)

    async_engine.register(async_steps_operation("held", Recorder(worker_db), gate=hold))
    plant_keys(worker_db, "held", 1)
    completer = Completer(async_engine, min_age=0)
    thread = threading.Thread(target=completer.run_forever, kwargs={"interval": 0.05})
    thread.start()
    try:
        assert entered.wait(60)
        completer.close()  # from another thread, mid-resume: left to the running loop
    finally:
        completer.stop()
        release.set()
        thread.join(60)

    assert not thread.is_alive()
    assert completer._loop is None  # closed by run_forever as it returned
    assert rows(worker_db, "SELECT response_status FROM idempotency_keys") == [(201,)]


@pytest.mark.slow
def test_sigterm_stops_the_workers_of_an_async_app_after_their_batch(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    keys = plant_keys(worker_db, ASYNC_OPERATION, 12, point="reserved")
    process = worker(
        "all", "--app", "async_worker_app:engine", "--min-age", "0", "--interval", "0.1",
        database_url=worker_database_url,
    )  # fmt: skip
    wait_for(lambda: rows(worker_db, "SELECT count(*) FROM published")[0][0] == len(keys))
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    for name in ("completer", "enqueuer", "reaper"):
        assert f"event=stopped worker={name}" in stderr


@pytest.mark.slow
def test_one_completer_resumes_the_keys_of_an_application_with_both_engines(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine, worker_database_url: str
) -> None:
    recorder = Recorder(worker_db)
    async_engine.register(async_steps_operation(ASYNC_OPERATION, recorder))
    sync_engine = rp.Engine(worker_database_url)
    sync_engine.register(steps_operation(SYNC_OPERATION, recorder))
    plant_keys(worker_db, ASYNC_OPERATION, 7)
    plant_keys(worker_db, SYNC_OPERATION, 5)

    completer = Completer((sync_engine, async_engine), batch_size=4, min_age=0)
    try:
        result = completer.run_once()
    finally:
        completer.close()
        sync_engine.dispose()

    assert (result.finished, result.unregistered, result.errors) == (12, 0, 0)
    by_operation = rows(
        worker_db,
        "SELECT operation, count(*) FROM idempotency_keys WHERE response_status = 201 "
        "GROUP BY operation ORDER BY operation",
    )
    assert by_operation == [(ASYNC_OPERATION, 7), (SYNC_OPERATION, 5)]
    assert phase_runs(worker_db) == {"reserved": 12, "finished": 12}


def test_a_second_engine_on_another_database_is_refused(
    async_engine: rp.AsyncEngine, database_url: str
) -> None:
    elsewhere = rp.Engine(database_url)
    try:
        with pytest.raises(ValueError, match="must share one database"):
            Completer((async_engine, elsewhere))
    finally:
        elsewhere.dispose()


@pytest.mark.slow
def test_engines_that_cannot_serve_together_are_refused(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine, worker_database_url: str
) -> None:
    recorder = Recorder(worker_db)
    async_engine.register(async_steps_operation(ASYNC_OPERATION, recorder))
    plant_keys(worker_db, ASYNC_OPERATION, 3)
    # Named twice, it is one engine: its keys are claimed and resumed once.
    twice = Completer((async_engine, async_engine), min_age=0)
    try:
        assert (twice.run_once().finished, step_calls(worker_db)) == (3, 3)
    finally:
        twice.close()
    other = rp.AsyncEngine(worker_database_url)
    other.register(async_steps_operation(ASYNC_OPERATION, recorder))
    with pytest.raises(ValueError, match="two engines register 'async_steps' v1"):
        Completer((async_engine, other))
    with pytest.raises(TypeError, match="got str"):
        Completer([async_engine, "myapp:engine"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no engine given"):
        Completer(())


def test_a_failing_async_key_backs_off_then_is_abandoned_with_a_replayed_error(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine
) -> None:
    recorder = Recorder(worker_db)
    async_engine.register(async_steps_operation("flaky", recorder, max_attempts=2))
    [key_id] = plant_keys(worker_db, "flaky", 1, point="reserved", params={"fail": "charged"})
    completer = Completer(async_engine, min_age=0)
    key = "SELECT attempts, next_attempt_at > now(), response_status FROM idempotency_keys"
    try:
        first = completer.run_once()
        assert (first.failed, first.abandoned) == (1, 0)
        assert rows(worker_db, key) == [(1, True, None)]  # backing off
        assert not completer.run_once()  # not due yet: untouched
        time_passes(worker_db)
        last = completer.run_once()
    finally:
        completer.close()

    assert (last.failed, last.abandoned) == (1, 1)
    status, body = rows(
        worker_db, "SELECT response_status, response_body FROM idempotency_keys WHERE id = :i",
        i=key_id,
    )[0]  # fmt: skip
    assert status == 500 and body["error"] == "request_abandoned"
    assert step_calls(worker_db) == 2


@pytest.mark.slow
def test_an_async_idempotent_key_is_backed_off_and_abandoned_without_rerunning_the_function(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine
) -> None:
    calls: list[str] = []

    @rp.idempotent(async_engine, key="order_id", max_attempts=3)
    async def charge(order_id: str, amount: int) -> int:
        calls.append(order_id)
        raise RuntimeError("the payment provider is down")

    with pytest.raises(RuntimeError):
        client_call(async_engine, charge("order-1", 500))
    completer = Completer(async_engine, min_age=0)
    attempts = "SELECT attempts, abandoned_at IS NOT NULL FROM idempotency_keys"
    try:
        time_passes(worker_db)
        first = completer.run_once()
        assert (first.failed, first.abandoned) == (1, 0)
        assert rows(worker_db, attempts) == [(2, False)]
        time_passes(worker_db)
        last = completer.run_once()
    finally:
        completer.close()

    assert (last.failed, last.abandoned) == (1, 1)
    assert rows(worker_db, attempts) == [(3, True)]
    with pytest.raises(rp.AbandonedCall):
        client_call(async_engine, charge("order-1", 500))
    assert calls == ["order-1"]  # only its caller ran it; the completer never did


@pytest.fixture
def async_app(
    worker_db: sa.Engine, async_engine: rp.AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> rp.AsyncEngine:
    """``--app rp_async_cli_app:engine``: an AsyncEngine knowing ``async_steps``."""
    async_engine.register(async_steps_operation(ASYNC_OPERATION, Recorder(worker_db)))
    module = types.ModuleType("rp_async_cli_app")
    module.engine = async_engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rp_async_cli_app", module)
    return async_engine


@pytest.mark.slow
def test_the_operator_commands_take_an_async_engine(
    async_app: rp.AsyncEngine,
    worker_db: sa.Engine,
    worker_database_url: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    op = async_app.operation(ASYNC_OPERATION, 1)
    client_call(async_app, async_app.run(op, key="k1", params={"n": 1}))
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
    app = ("--app", "rp_async_cli_app:engine")

    def run(*args: str) -> Any:
        status = main([*args, *app, "--json"])
        out, err = capsys.readouterr()
        assert status == EXIT_OK, err
        return json.loads(out)

    shown = run("keys", "show", str(key_id))
    assert [p["point"] for p in shown["phases"]] == ["started", "reserved", "charged", "finished"]
    assert [k["id"] for k in run("keys", "list")] == [key_id]
    assert [j["job_name"] for j in run("jobs", "list")] == ["notify"]
    assert {c["name"]: c["status"] for c in run("doctor")}["schema"] == "ok"
    elsewhere = rp.Engine(database_url)  # another database
    monkeypatch.setattr(sys.modules["rp_async_cli_app"], "elsewhere", elsewhere, raising=False)
    status = main(["keys", "list", *app, "--app", "rp_async_cli_app:elsewhere"])
    assert status == EXIT_USAGE
    assert "must share one database" in capsys.readouterr().err
    parsed = argparse.Namespace(app=["rp_async_cli_app:engine"], database_url=None)
    db, operations = metrics._database(parsed)
    assert db.url.database == sa.make_url(worker_database_url).database
    assert [o.name for o in operations] == [ASYNC_OPERATION]


def _work_for(kind: str, db: sa.Engine) -> int:
    """Work for the worker ``kind`` of ``async_worker_app``: keys its clients left (the
    completer's), jobs its async phases staged (the enqueuer's), keys finished four days ago
    (the reaper's, past the default 72h). How many there are."""
    if kind == "completer":
        return len(plant_keys(db, ASYNC_OPERATION, 3, point="reserved"))
    if kind == "enqueuer":
        return len(stage_jobs(db, 4))
    old = "now() - interval '4 days'"
    return len(
        plant_keys(db, ASYNC_OPERATION, 5, point="finished", finished_at=old, response_status="201")
    )


_DONE = {
    "completer": "SELECT count(*) FROM idempotency_keys WHERE response_status = 201",
    "enqueuer": "SELECT count(DISTINCT job_key) FROM published",
    "reaper": "SELECT 5 - count(*) FROM idempotency_keys",
}
_LEFT = {
    "completer": "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL",
    "enqueuer": "SELECT count(*) FROM staged_jobs",
    "reaper": "SELECT count(*) FROM idempotency_keys",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completer", "enqueuer", "reaper"])
def test_each_worker_command_runs_alone_on_an_async_app(
    kind: str, worker_db: sa.Engine, worker_database_url: str
) -> None:
    """``recoverypoint worker KIND --once --app async_worker_app:engine``: each worker on its
    own takes the AsyncEngine alone and does its work."""
    count = _work_for(kind, worker_db)

    stderr = run_worker(worker_database_url, kind, "engine")

    assert f"event=pass worker={kind} " in stderr, stderr
    assert rows(worker_db, _DONE[kind]) == [(count,)]
    assert rows(worker_db, _LEFT[kind]) == [(0,)]
    if kind == "enqueuer":  # each job once
        assert rows(worker_db, "SELECT count(*) FROM published") == [(count,)]


def test_the_enqueuer_and_the_reaper_take_an_async_engine_from_python(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    """``Enqueuer(async_engine)`` publishes to the AsyncEngine's job backend; ``Reaper(
    async_engine)`` holds each key to the retention of the AsyncEngine's operation."""
    backend = InProcessBackend()
    recorder = Recorder(worker_db)
    backend.handler(JOB)(lambda job: recorder.published(job))
    engine = rp.AsyncEngine(worker_database_url, jobs=backend)
    engine.register(async_steps_operation("brief", recorder, retention=timedelta(hours=1)))
    staged = stage_jobs(worker_db, 6)
    for operation, count in (("brief", 3), ("unknown_here", 2)):  # past its 1h; within 72h
        plant_keys(
            worker_db,
            operation,
            count,
            point="finished",
            finished_at="now() - interval '2 hours'",
            response_status="201",
        )
    try:
        published = Enqueuer(engine).run_once()
        reaped = Reaper(engine).run_once()
    finally:
        asyncio.run(engine.dispose())

    assert (published.published, published.failed) == (len(staged), 0)
    assert sorted(k for (k,) in rows(worker_db, "SELECT job_key FROM published")) == sorted(staged)
    assert reaped.finished == 3
    by_operation = "SELECT operation, count(*) FROM idempotency_keys GROUP BY 1"
    assert rows(worker_db, by_operation) == [("unknown_here", 2)]


def _without_database_url() -> dict[str, str]:
    """The environment of a command that must find its database through ``--app`` alone."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in (DATABASE_URL_ENV, "RECOVERYPOINT_CONSOLE_TOKEN")
    }


@pytest.mark.slow
def test_the_console_command_takes_an_async_engine(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    """``recoverypoint console --app async_worker_app:engine``: its database and its
    operations (a key's phases) come from the AsyncEngine."""
    [key_id] = plant_keys(worker_db, ASYNC_OPERATION, 1, point="reserved")
    [other_id] = plant_keys(worker_db, "unknown_here", 1, point="reserved")
    command = [sys.executable, "-m", "recoverypoint", "console", "--no-token", "--bind",
               "127.0.0.1:0", "--app", "async_worker_app:engine"]  # fmt: skip
    env = {**_without_database_url(), "RP_WORKER_TEST_DATABASE_URL": worker_database_url}
    process = subprocess.Popen(
        command, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("console on http://127.0.0.1:"), process.communicate(timeout=30)
        url = line.split()[-1].rstrip("/")
        with urllib.request.urlopen(f"{url}/keys/{key_id}", timeout=30) as page:
            known = page.read().decode()
        with urllib.request.urlopen(f"{url}/keys/{other_id}", timeout=30) as page:
            unknown = page.read().decode()
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)

    assert 'id="phases"' in known and "does not know" not in known
    assert all(point in known for point in ("reserved", "charged", "finished"))
    assert "does not know unknown_here@1" in unknown  # the page tells them apart
    assert "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_the_metrics_command_takes_an_async_engine(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    """``recoverypoint metrics serve --app async_worker_app:engine``: the database is the
    AsyncEngine's, and its operations have their series before any key of theirs exists."""
    command = [sys.executable, "-m", "recoverypoint", "metrics", "serve", "--bind",
               "127.0.0.1:0", "--app", "async_worker_app:engine"]  # fmt: skip
    env = {**_without_database_url(), "RP_WORKER_TEST_DATABASE_URL": worker_database_url}

    def in_flight(url: str) -> float:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        found = {
            (sample.name, sample.labels.get("operation")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert found[("recoverypoint_collector_up", None)] == 1
        return found[("recoverypoint_keys_in_flight", ASYNC_OPERATION)]

    process = subprocess.Popen(
        command, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "serving metrics on http://127.0.0.1:PORT/metrics"
        assert line.startswith("serving metrics on "), process.communicate(timeout=30)
        url = line.split()[-1]
        before = in_flight(url)  # no key yet: the series is there from --app alone
        plant_keys(worker_db, ASYNC_OPERATION, 2, locked_at="now()", lock_token="gen_random_uuid()")
        after = in_flight(url)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)

    assert (before, after) == (0, 2)
    assert process.returncode == 0, stderr


_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)))
_MODULE = st.sampled_from(["rp_hostile_app"]) | st.builds(
    "".join, st.tuples(st.sampled_from(["rp_absent", ".", "..", "rp_hostile_app."]), _TEXT)
)
_ATTR = st.sampled_from(["sync_a", "async_a", "async_a2", "sync_b", "backend", "nothing"]) | _TEXT
_SPEC = st.builds(lambda m, sep, a: f"{m}{sep}{a}", _MODULE, st.sampled_from([":", ""]), _ATTR)


@pytest.fixture(scope="module")
def hostile_app() -> Iterator[types.ModuleType]:
    """Engines that never connect: two on database ``a`` (one of each kind), one on ``b``."""
    module = types.ModuleType("rp_hostile_app")
    module.sync_a = rp.Engine("postgresql://127.0.0.1:1/a")  # type: ignore[attr-defined]
    module.async_a = rp.AsyncEngine("postgresql://127.0.0.1:1/a")  # type: ignore[attr-defined]
    module.async_a2 = rp.AsyncEngine("postgresql://u@127.0.0.1:1/a")  # type: ignore[attr-defined]
    module.sync_b = rp.Engine("postgresql://127.0.0.1:1/b")  # type: ignore[attr-defined]
    module.backend = object()  # type: ignore[attr-defined]
    sys.modules["rp_hostile_app"] = module
    yield module
    del sys.modules["rp_hostile_app"]


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_SPEC, min_size=1, max_size=4))
@pytest.mark.slow
def test_any_app_options_give_engines_on_one_database_or_a_usage_error(
    hostile_app: types.ModuleType, specs: list[str]
) -> None:
    try:
        engines = load_engines(specs)
    except UsageError as exc:
        assert str(exc).startswith("--app")
        return
    named = [getattr(hostile_app, spec.split(":", 1)[1]) for spec in specs]
    assert engines.all == tuple(dict.fromkeys(named))
    assert len({engine.db.url.database for engine in engines.all}) == 1
