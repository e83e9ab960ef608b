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
from workload import rows, stage_jobs, wait_for

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
        ("no_such_module:engine", "cannot import 'no_such_module'"),
        ("worker_app:nothing", "has no attribute 'nothing'"),
        ("worker_app:backend", "expected a recoverypoint.Engine, got InProcessBackend"),
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
