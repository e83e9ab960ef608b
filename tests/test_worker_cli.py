"""``recoverypoint worker``: start-up failures in one line, and SIGTERM or SIGINT in the
middle of a batch: the batch commits whole, the command exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from workload import plant_keys, rows, stage_jobs, wait_for

pytestmark = pytest.mark.slow  # the workers' commands as subprocesses, signalled

TESTS = Path(__file__).resolve().parent
UNREACHABLE_URL = "postgresql://127.0.0.1:1/x"  # nothing listens on port 1
# ts=… level=… logger=… then key=value pairs, quoted when they hold spaces.
LOGFMT_LINE = re.compile(r'ts=\S+ level=\w+ logger=\S+( \w+=("([^"\\]|\\.)*"|\S+))+')


def worker(*args: str, database_url: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "recoverypoint", "worker", *args],
        cwd=TESTS,
        env={**os.environ, "RP_WORKER_TEST_DATABASE_URL": database_url, **env},
        stderr=subprocess.PIPE,
        text=True,
    )


def test_an_unreachable_database_fails_at_start_in_one_line() -> None:
    process = worker("all", "--app", "worker_app:engine", database_url=UNREACHABLE_URL)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 1
    [line] = stderr.strip().splitlines()
    assert line.startswith("recoverypoint worker: error: ")
    assert "127.0.0.1" in line and "refused" in line


def test_an_unmigrated_database_fails_at_start(empty_database_url: str) -> None:
    process = worker("reaper", "--app", "worker_app:engine", database_url=empty_database_url)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 1
    assert "run `recoverypoint migrate` first" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ("worker_app", "--app must be MODULE:ATTR"),
        (".worker_app:engine", "MODULE must be absolute"),
        ("no_such_module:engine", "cannot import 'no_such_module'"),
        ("worker_app:nothing", "has no attribute 'nothing'"),
        (
            "worker_app:backend",
            "expected a recoverypoint.Engine or AsyncEngine, got InProcessBackend",
        ),
    ],
)
def test_a_bad_app_is_a_usage_error(app: str, message: str) -> None:
    process = worker("completer", "--once", "--app", app, database_url=UNREACHABLE_URL)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 2
    assert message in stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_batch_lets_the_batch_commit_and_exits_0(
    worker_db: sa.Engine, worker_database_url: str, signum: signal.Signals
) -> None:
    stage_jobs(worker_db, 300)
    process = worker(
        "all", "--app", "worker_app:engine", "--batch-size", "100", "--min-age", "0",
        database_url=worker_database_url,
        RP_WORKER_TEST_PUBLISH_DELAY="0.01",  # a batch of 100 jobs takes a second
    )  # fmt: skip
    in_flight = "SELECT count(*) FROM published JOIN staged_jobs USING (job_key)"
    wait_for(lambda: rows(worker_db, in_flight)[0][0] >= 3)

    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    published = {r.job_key for r in rows(worker_db, "SELECT job_key FROM published")}
    staged = {r.job_key for r in rows(worker_db, "SELECT job_key FROM staged_jobs")}
    # The batch in flight committed whole: what was published is gone from staged_jobs,
    # what is still staged was not published; and it stopped before draining everything.
    assert published.isdisjoint(staged)
    assert len(published) + len(staged) == 300
    assert len(published) % 100 == 0 and staged
    lines = stderr.splitlines()
    assert all(LOGFMT_LINE.fullmatch(line) for line in lines), stderr
    assert f"event=signal signal={signum.name} count=1" in stderr
    for name in ("completer", "enqueuer", "reaper"):
        assert f"event=stopped worker={name}" in stderr


# -- every flag reaches its worker -------------------------------------------------------


def finished_ago(age: str, *, abandoned: bool = False) -> dict[str, str]:
    """Columns of a key finished (or abandoned) ``age`` ago, e.g. ``'3 hours'``."""
    at = f"now() - interval '{age}'"
    columns = {"point": "finished", "response_status": "200", "finished_at": at, "last_run_at": at}
    return {**columns, "abandoned_at": at} if abandoned else columns


def events(stderr: str, event: str) -> dict[str, dict[str, str]]:
    """The fields of each worker's ``event`` line (its first one), by worker."""
    found: dict[str, dict[str, str]] = {}
    for line in stderr.splitlines():
        if f" event={event} " in line:
            fields = dict(pair.split("=", 1) for pair in line.split() if "=" in pair)
            found.setdefault(fields["worker"], fields)
    return found


def test_every_flag_of_a_pass_reaches_its_worker(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    # Each duration flag has a value of its own, so that one wired to another shows.
    # The completer's keys: their clients last ran them 10 minutes or 1 hour ago.
    waiting = plant_keys(worker_db, "steps", 2, last_run_at="now() - interval '10 minutes'")
    due = plant_keys(worker_db, "steps", 3, last_run_at="now() - interval '1 hour'")
    # The reaper's: finished 1 or 3 hours ago, abandoned 4 or 6 hours ago.
    kept = [
        *plant_keys(worker_db, "op", 2, **finished_ago("1 hour")),
        *plant_keys(worker_db, "op", 1, **finished_ago("4 hours", abandoned=True)),
    ]
    plant_keys(worker_db, "op", 3, **finished_ago("3 hours"))
    plant_keys(worker_db, "op", 1, **finished_ago("6 hours", abandoned=True))
    jobs = stage_jobs(worker_db, 7)

    process = worker(
        "all", "--app", "worker_app:engine", "--once", "--batch-size", "2",
        "--min-age", "30m", "--retention", "2h", "--abandoned-retention", "5h",
        database_url=worker_database_url,
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    passes = events(stderr, "pass")
    # --min-age 30m: only the keys last run an hour ago; --batch-size 2: in 2 batches.
    assert (passes["completer"]["finished"], passes["completer"]["batches"]) == ("3", "2")
    finished = rows(worker_db, "SELECT id FROM idempotency_keys WHERE response_status = 201")
    assert sorted(r.id for r in finished) == due
    # 7 staged jobs and the 3 the completer's keys staged, 2 a batch, the last one empty.
    assert (passes["enqueuer"]["published"], passes["enqueuer"]["batches"]) == ("10", "6")
    published = {r.job_key for r in rows(worker_db, "SELECT job_key FROM published")}
    assert published.issuperset(jobs) and len(published) == 10
    # --retention 2h and --abandoned-retention 5h; 4 keys, 2 a batch, the last one empty;
    # then one batch each, empty, of generations and of consume-once records (across
    # scopes on one server, they are asked for whether or not any is due).
    reaper = passes["reaper"]
    assert (reaper["finished"], reaper["abandoned"], reaper["batches"]) == ("3", "1", "5")
    remaining = {r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")}
    assert remaining == {*waiting, *due, *kept}


@pytest.mark.parametrize("kind", ["completer", "all"])
def test_the_interval_and_batch_size_reach_the_running_workers(
    worker_db: sa.Engine, worker_database_url: str, kind: str
) -> None:
    # 12 jobs for `all` (its enqueuer), 7 keys for the completer alone.
    if kind == "all":
        stage_jobs(worker_db, 12)
        work_done = "SELECT count(*) = 12 FROM published"
    else:
        plant_keys(worker_db, "steps", 7, last_run_at="now() - interval '1 hour'")
        work_done = "SELECT count(*) = 7 FROM idempotency_keys WHERE response_status = 201"
    process = worker(
        kind, "--app", "worker_app:engine", "--interval", "0.25", "--batch-size", "5",
        database_url=worker_database_url,
    )  # fmt: skip
    wait_for(lambda: rows(worker_db, work_done)[0][0])
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    started = events(stderr, "started")
    assert sorted(started) == (["completer", "enqueuer", "reaper"] if kind == "all" else [kind])
    for fields in started.values():
        assert (fields["interval"], fields["batch_size"]) == ("0.25", "5")
    busy = "enqueuer" if kind == "all" else kind
    assert events(stderr, "pass")[busy]["batches"] == ("3" if kind == "all" else "2")


def test_the_log_level_reaches_the_loggers(worker_db: sa.Engine, worker_database_url: str) -> None:
    plant_keys(worker_db, "op", 2, **finished_ago("4 days"))

    process = worker(
        "reaper", "--app", "worker_app:engine", "--once", "--log-level", "WARNING",
        database_url=worker_database_url,
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0
    assert stderr == ""  # the pass (INFO) was not logged
    assert rows(worker_db, "SELECT * FROM idempotency_keys") == []  # yet it happened


def test_a_pass_by_hand_says_why_it_left_keys_alone(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    # As `keys retry` leaves a key a client ran a moment ago: due now, its last run recent.
    recent = plant_keys(worker_db, "steps", 1)
    later = plant_keys(worker_db, "steps", 2, last_run_at="now() - interval '1 hour'",
                       next_attempt_at="now() + interval '1 hour'")  # fmt: skip
    held = plant_keys(worker_db, "steps", 1, last_run_at="now() - interval '1 hour'",
                      locked_at="now()", lock_token="gen_random_uuid()")  # fmt: skip
    process = worker(
        "completer", "--app", "worker_app:engine", "--once", database_url=worker_database_url
    )
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    pass_ = events(stderr, "pass")["completer"]
    assert (pass_["finished"], pass_["too_recent"], pass_["backing_off"], pass_["leased"]) == (
        "0", "1", "2", "1"
    )
    assert (
        "completer: skipped 1 key younger than --min-age 60s, which leaves their clients time "
        "to retry (--min-age 0, or recoverypoint keys retry ID, takes them now); 2 keys whose "
        "next attempt is not due yet "
        "(recoverypoint keys retry ID makes it due now); 1 key a running request holds"
    ) in stderr
    unfinished = rows(worker_db, "SELECT id FROM idempotency_keys WHERE finished_at IS NULL")
    assert sorted(r.id for r in unfinished) == sorted([*recent, *later, *held])

    process = worker(
        "completer", "--app", "worker_app:engine", "--once", "--min-age", "0",
        database_url=worker_database_url,
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)
    assert events(stderr, "pass")["completer"]["finished"] == "1"
    assert "younger than --min-age" not in stderr
