"""Keys and jobs no running worker can finish: the keys of an operation version no running
completer registers (a deploy whose ``--app`` module misses an import), and the staged jobs
the job backend has no handler for. The pass that meets them logs an error naming them and
the ``--app``, sets a gauge and fails ``--once``; ``doctor`` and the console report them
from any process, ``--app`` or not; a version another running completer registers is left
to it. Abandoned keys alone, awaiting the compensation of a version nobody registers (a
retired one, which may declare none), are a warning that fails nothing."""

from __future__ import annotations

import json
import logging
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import MOUNT, app_for, client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_worker_cli import worker
from workload import Recorder, plant_keys, rows, stage_jobs, steps_operation

import recoverypoint as rp
from recoverypoint.cli import main
from recoverypoint.integrations.prometheus import PrometheusObserver
from recoverypoint.logfmt import logfmt
from recoverypoint.running import RUNNING, late
from recoverypoint.workers import Completer

DUE = {"last_run_at": "now() - interval '1 day'", "next_attempt_at": "now() - interval '1 day'"}
AWAITING_COMPENSATION = {
    "point": "reserved",
    "finished_at": "now() - interval '1 day'",
    "abandoned_at": "now() - interval '1 day'",
    "compensation_due_at": "now() - interval '1 day'",
    "response_status": "500",
}


def steps_engine(db: sa.Engine, registry: CollectorRegistry | None = None) -> rp.Engine:
    """An application that registers ``steps`` v1 only, as worker_app does."""
    observer = PrometheusObserver(registry) if registry is not None else None
    engine = rp.Engine(db, observer=observer)
    engine.register(steps_operation("steps", Recorder(db)))
    return engine


def another_completer_registers(db: sa.Engine, operation: str, version: int) -> None:
    """What a completer running elsewhere records with its passes: what it can finish."""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO completer_operations "
                "(completer, host, pid, operations, versions, interval_seconds) "
                "VALUES (:id, 'elsewhere', 1, ARRAY[:operation], ARRAY[:version], 5.5)"
            ),
            {"id": uuid.uuid4(), "operation": operation, "version": version},
        )


def doctor(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    status = main(["doctor", "--database-url", url, "--json"])
    found = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    return status, found["unfinishable"]


def samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a Prometheus text file, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }


@pytest.mark.slow
def test_a_pass_that_meets_what_nobody_can_finish_fails_and_says_what_to_import(
    worker_db: sa.Engine, worker_database_url: str, tmp_path: Path
) -> None:
    ghosts = plant_keys(worker_db, "ghost", 2, version=3, **DUE)
    [known] = plant_keys(worker_db, "steps", 1, **DUE)
    stage_jobs(worker_db, 1, name="nobody_handles")
    metrics = tmp_path / "metrics.prom"

    process = worker(
        "all", "--once", "--app", "worker_app:engine",
        database_url=worker_database_url, RP_WORKER_TEST_METRICS=str(metrics),
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 1, stderr
    [keys] = [line for line in stderr.splitlines() if " event=unfinishable " in line]
    assert "level=error" in keys and "operation=ghost version=3 keys=2 " in keys
    assert "app=worker_app:engine" in keys and "import the module that registers it" in keys
    [jobs] = [line for line in stderr.splitlines() if " event=unknown_job " in line]
    assert "level=error" in jobs and "job_name=nobody_handles jobs=1 " in jobs
    assert "app=worker_app:engine" in jobs and "@backend.handler" in jobs
    last = stderr.splitlines()[-1]
    assert last.startswith("recoverypoint worker: error: ") and "2 keys and 1 job" in last
    # The rest of the pass was done; what nobody can finish was left as it was.
    finished = rows(worker_db, "SELECT id FROM idempotency_keys WHERE response_status = 201")
    assert [r.id for r in finished] == [known]
    left = rows(worker_db, "SELECT id, attempts, locked_at FROM idempotency_keys "
                           "WHERE operation = 'ghost' ORDER BY id")  # fmt: skip
    assert [tuple(r) for r in left] == [(ghost, 0, None) for ghost in ghosts]
    [job] = rows(worker_db, "SELECT job_name, attempts, last_error FROM staged_jobs")
    assert (job.job_name, job.attempts) == ("nobody_handles", 1)
    assert job.last_error.startswith("UnknownJob: no handler for job 'nobody_handles'")
    found = samples(metrics)
    assert found[("recoverypoint_unfinishable_keys", (("operation", "ghost"),))] == 2
    assert found[("recoverypoint_unknown_jobs_total", (("job", "nobody_handles"),))] == 1


def test_a_version_another_running_completer_registers_is_left_to_it(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    plant_keys(worker_db, "steps", 2, version=2, **DUE)  # the next deploy's version
    registry = CollectorRegistry()
    completer = Completer(steps_engine(worker_db, registry), min_age=0)

    counted = {"operation": "steps"}
    gauge: list[float | None] = []

    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        alone = completer.run_once()
        gauge.append(registry.get_sample_value("recoverypoint_unfinishable_keys", counted))
        another_completer_registers(worker_db, "steps", 2)
        shared = completer.run_once()
        gauge.append(registry.get_sample_value("recoverypoint_unfinishable_keys", counted))

    with worker_db.begin() as conn:  # the other one stopped an hour ago
        conn.execute(sa.text("UPDATE completer_operations SET recorded_at = now() - "
                             "interval '1 hour' WHERE host = 'elsewhere'"))  # fmt: skip
    stopped = completer.run_once()
    again = completer.run_once()  # the same keys, found again: set, not added
    gauge.append(registry.get_sample_value("recoverypoint_unfinishable_keys", counted))

    assert (alone.unregistered, alone.unfinishable) == (2, 2)
    assert (shared.unregistered, shared.unfinishable) == (2, 0)
    assert (
        (stopped.unregistered, stopped.unfinishable)
        == (2, 2)
        == (
            again.unregistered,
            again.unfinishable,
        )
    )
    # Forgotten by the pass that found it stopped: the record of this completer is left.
    assert [r.host for r in rows(worker_db, "SELECT host FROM completer_operations")] == [
        socket.gethostname()
    ]
    errors = [r for r in caplog.records if "event=unfinishable" in r.getMessage()]
    assert [r.levelno for r in errors] == [logging.ERROR] * 2  # alone, and once it stopped
    assert all("operation=steps version=2 keys=2" in r.message for r in errors)
    [left] = [r for r in caplog.records if "event=unregistered" in r.getMessage()]
    assert left.levelno == logging.INFO and "another running completer" in left.message
    # The last pass of each: 2 found alone, 0 once left to the other, 2 once it stopped.
    assert gauge == [2, 0, 2]


@pytest.mark.slow
def test_a_retired_version_s_abandoned_keys_warn_and_fail_nothing(
    worker_db: sa.Engine,
    worker_database_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A version no deploy registers any more, declaring no compensation: every abandonment
    # made one due all the same, and nobody can tell it owes none.
    plant_keys(worker_db, "ghost", 2, version=3, **AWAITING_COMPENSATION)
    metrics = tmp_path / "metrics.prom"

    process = worker(
        "completer", "--once", "--app", "worker_app:engine",
        database_url=worker_database_url, RP_WORKER_TEST_METRICS=str(metrics),
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    assert " event=unfinishable " not in stderr
    [line] = [line for line in stderr.splitlines() if " event=compensations_unregistered " in line]
    assert "level=warning" in line and "operation=ghost version=3 keys=0 compensations=2" in line
    assert "declares none owes nothing" in line and "app=worker_app:engine" in line
    assert ("recoverypoint_unfinishable_keys", (("operation", "ghost"),)) not in samples(metrics)
    left = rows(worker_db, "SELECT compensated_at, locked_at FROM idempotency_keys")
    assert [tuple(r) for r in left] == [(None, None)] * 2
    # The completer that ran is not late yet: doctor warns, and fails nothing either.
    _, check = doctor(worker_database_url, capsys)
    assert check["status"] == "warn" and "ghost v3: 2 abandoned keys awaiting" in check["detail"]
    assert "declares none owes nothing" in check["hint"]

    plant_keys(worker_db, "ghost", 1, version=3, **DUE)  # with an unfinished one: an error
    status, check = doctor(worker_database_url, capsys)
    assert (status, check["status"]) == (1, "fail")


@pytest.mark.slow
def test_doctor_reports_them_without_an_app(
    worker_db: sa.Engine, worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plant_keys(worker_db, "ghost", 2, version=3, **DUE)
    plant_keys(worker_db, "ghost", 1, version=3, **AWAITING_COMPENSATION)
    plant_keys(worker_db, "steps", 1, **DUE)  # registered: the completer's to finish

    # No completer ran yet: that is the workers check's to say; this one says what waits.
    status, check = doctor(worker_database_url, capsys)
    assert check["status"] == "warn" and "no completer is running" in check["detail"]

    Completer(steps_engine(worker_db), min_age=0).run_once()
    status, check = doctor(worker_database_url, capsys)
    assert status == 1 and check["status"] == "fail"
    assert "ghost v3: 2 stuck keys, 1 abandoned key awaiting a compensation" in check["detail"]
    assert "steps" not in check["detail"]
    assert "import the module that registers them" in check["hint"]

    stage_jobs(worker_db, 1, name="nobody_handles")
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE staged_jobs SET attempts = 1, last_error = :e"),
                     {"e": "UnknownJob: no handler for job 'nobody_handles'"})  # fmt: skip
    another_completer_registers(worker_db, "ghost", 3)
    status, check = doctor(worker_database_url, capsys)
    assert status == 1 and "ghost" not in check["detail"]
    assert "job nobody_handles: 1 staged, no handler" in check["detail"]

    with worker_db.begin() as conn:
        conn.execute(sa.text("DELETE FROM staged_jobs"))
    status, check = doctor(worker_database_url, capsys)
    assert (status, check["status"]) == (0, "ok")


def test_the_console_shows_them(worker_db: sa.Engine) -> None:
    engine = steps_engine(worker_db)
    with client(app_for(engine), "viewer") as browser:
        assert 'id="unfinishable"' not in browser.get(f"{MOUNT}/").text
    plant_keys(worker_db, "ghost", 2, version=3, **DUE)
    Completer(engine, min_age=0).run_once()

    with client(app_for(engine), "viewer") as browser:
        page = browser.get(f"{MOUNT}/").text

    assert 'id="unfinishable"' in page
    assert "Keys no running worker can finish" in page
    assert "ghost@3" in page and "import the module that registers" in page


@settings(
    max_examples=20,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    planted=st.dictionaries(
        st.tuples(
            st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1,
                     max_size=30),
            st.integers(1, 2**31 - 1),
        ),
        st.integers(1, 3),
        min_size=1,
        max_size=4,
    )
)  # fmt: skip
@pytest.mark.slow
def test_any_operation_a_key_names_is_reported_whole(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture, planted: dict[tuple[str, int], int]
) -> None:
    with worker_db.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys"))
    planted = {ident: count for ident, count in planted.items() if ident != ("steps", 1)}
    for (name, version), count in planted.items():
        plant_keys(worker_db, name, count, version=version, **DUE)
    caplog.clear()

    with caplog.at_level(logging.ERROR, logger="recoverypoint.workers"):
        result = Completer(steps_engine(worker_db), min_age=0).run_once()

    assert result.unfinishable == result.unregistered == sum(planted.values())
    errors = [r.getMessage() for r in caplog.records if "event=unfinishable" in r.getMessage()]
    assert len(errors) == len(planted)
    for (name, version), count in planted.items():
        named = f"{logfmt(operation=name)} version={version} keys={count} "
        assert sum(named in line for line in errors) == 1, (named, errors)


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    age=st.floats(0, 10_000, allow_nan=False),
    interval=st.none() | st.floats(0, 3_000, allow_nan=False),
)
def test_a_completer_is_running_in_sql_as_doctor_judges_a_worker_late(
    worker_db: sa.Engine, age: float, interval: float | None
) -> None:
    threshold = 300.0 if interval is None else 3 * interval + 30
    if abs(age - threshold) < 1:  # the clock moves between here and the statement
        return
    statement = sa.text(
        f"SELECT {RUNNING} FROM (SELECT now() - make_interval(secs => :age) AS recorded_at, "
        "CAST(:interval AS double precision) AS interval_seconds) AS c"
    )
    with worker_db.connect() as conn:
        running = conn.execute(statement, {"age": age, "interval": interval}).scalar_one()
    assert running is not late(age, interval)
