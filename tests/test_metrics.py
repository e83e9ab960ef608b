"""Prometheus metrics: a Rocket Rides flow with faults (failures and retries, a replay, a
mismatch, a key in use, a takeover, real serialization failures), then the completer,
the enqueuer and the reaper, all observed into one registry that is served over HTTP on
a loopback port and scraped; every counter, histogram and database gauge is checked."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from observing import conflicting_operation
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from rides import SCHEMA, Faults, Provider, ride_operation
from workload import plant_keys, rows, stage_jobs

import recoverypoint as rp
from recoverypoint.integrations.prometheus import DatabaseCollector, PrometheusObserver
from recoverypoint.jobs import InProcessBackend, Job, consume_once
from recoverypoint.workers import Completer, Enqueuer, Reaper

RIDES, BUMP, JOB = "metrics_rides", "metrics_bump", "send_ride_receipt"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def served(worker_db: sa.Engine) -> Iterator[tuple[CollectorRegistry, str]]:
    registry = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield registry, f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.slow
def test_a_scrape_after_a_rides_flow_with_faults_counts_everything(
    worker_db: sa.Engine, served: tuple[CollectorRegistry, str]
) -> None:
    registry, url = served
    with worker_db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    observer = PrometheusObserver(registry)
    broker_down = [True]

    def send_receipt(job: Job) -> None:
        if broker_down:
            broker_down.clear()
            raise ConnectionError("broker went away")
        with worker_db.begin() as conn:
            consume_once(conn, JOB, job.job_key, observer=observer)

    faults = Faults()
    rides = ride_operation(RIDES, Provider(worker_db), faults)
    conflicts = [1]
    bump = conflicting_operation(BUMP, worker_db, conflicts)
    backend = InProcessBackend({JOB: send_receipt})
    engine = rp.Engine(worker_db, observer=observer, jobs=backend, retry_base=0.0)
    engine.register(rides, bump)
    registry.register(DatabaseCollector(worker_db, engine.operations))

    def ride(key: str, **params: Any) -> rp.Outcome:
        return engine.run(rides, key=key, scope="s", params={"scope": "s", **params})

    # k1: new, then replayed, then reused with other params.
    assert ride("k1").status == 201
    assert ride("k1").replayed
    with pytest.raises(rp.ParamsMismatch):
        ride("k1", customer="someone else")
    # k2: the provider fails after charging; the client's retry resumes it.
    faults.armed.add("charge_created:after_call")
    with pytest.raises(Exception, match="charge_created:after_call"):
        ride("k2")
    assert not ride("k2").replayed
    # k3: a second request with the key while the first is at its foreign step.
    in_use: list[BaseException] = []

    def second_request() -> None:
        del faults.hooks["charge_created:before_call"]
        with pytest.raises(rp.KeyInUse) as refused:
            ride("k3")
        in_use.append(refused.value)

    faults.hooks["charge_created:before_call"] = second_request
    assert ride("k3").status == 201
    assert len(in_use) == 1

    # k4: the lease expires during the foreign step and a retry takes the key over and
    # finishes it; the first request's next commit is fenced out.
    def take_over() -> None:
        del faults.hooks["charge_created:before_call"]
        with worker_db.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET locked_at = now() - interval '1 hour' "
                    "WHERE idempotency_key = 'k4'"
                )
            )
        assert ride("k4").status == 201

    faults.hooks["charge_created:before_call"] = take_over
    with pytest.raises(rp.LockLost):
        ride("k4")
    # k5: the last phase fails; the client gives up and the completer finishes it.
    faults.armed.add("finished:start")
    with pytest.raises(Exception, match="finished:start"):
        ride("k5")
    with pytest.raises(rp.InvalidKey):
        ride("")
    # A real serialization failure, retried; then one that outlasts the retries.
    assert engine.run(bump, key="b1", params={}).status == 200
    assert conflicts == [0]
    # Its key waits an hour for its next attempt: the completer below leaves it alone.
    impatient = rp.Engine(worker_db, observer=observer, serialization_retries=1, retry_base=7200)
    impatient.register(bump)
    conflicts[0] = 5
    with pytest.raises(rp.ConcurrentUpdate):
        impatient.run(bump, key="b2", params={})

    [abandoned_id] = plant_keys(worker_db, RIDES, 1, attempts="99")
    completed = Completer(engine, min_age=0).run_once()
    assert (completed.finished, completed.abandoned) == (1, 1)

    first = Enqueuer(engine).run_once()
    assert (first.published, first.failed) == (4, 1)
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE staged_jobs SET next_attempt_at = now()"))
    assert Enqueuer(engine).run_once().published == 1
    [redelivered] = rows(worker_db, "SELECT message_id FROM processed_messages LIMIT 1")
    with worker_db.begin() as conn:
        assert not consume_once(conn, JOB, redelivered.message_id, observer=observer)

    reaped = Reaper(engine, retention=timedelta(0), processed_retention=timedelta(0)).run_once()
    assert (reaped.finished, reaped.abandoned, reaped.messages) == (6, 0, 5)

    # What the database gauges see: a stuck key, one in flight, one waiting, two jobs.
    plant_keys(
        worker_db,
        RIDES,
        1,
        next_attempt_at="now() - interval '1 hour'",
        created_at="now() - interval '2 hours'",
    )
    plant_keys(worker_db, RIDES, 1, locked_at="now()", lock_token="gen_random_uuid()")
    plant_keys(worker_db, RIDES, 1, next_attempt_at="now() + interval '1 hour'")
    stage_jobs(worker_db, 2)
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE staged_jobs SET created_at = now() - interval '90 seconds', "
                "attempts = CASE WHEN job_args->>'n' = '1' THEN 1 ELSE 0 END"
            )
        )

    before = time.time()
    samples = scrape(url)

    def requests(outcome: str, operation: str = RIDES) -> float:
        return value(samples, "recoverypoint_requests_total", operation=operation, outcome=outcome)

    assert {
        outcome: requests(outcome)
        for outcome in (
            "new",
            "resumed",
            "replayed",
            "in_use",
            "mismatch",
            "invalid",
            "lock_lost",
            "failed",
        )
    } == {
        "new": 2,  # k1, k3 (k4's first request ended lock_lost)
        "resumed": 2,  # k2's retry, k4's takeover
        "replayed": 1,
        "in_use": 1,
        "mismatch": 1,
        "invalid": 1,
        "lock_lost": 1,
        "failed": 2,  # k2, k5
    }
    assert (requests("new", BUMP), requests("failed", BUMP)) == (1, 1)
    duration = "recoverypoint_request_duration_seconds_count"
    assert value(samples, duration, operation=RIDES, outcome="resumed") == 2
    assert value(samples, duration, operation=BUMP, outcome="failed") == 1

    def by_point(name: str, point: str, operation: str = RIDES) -> float:
        return value(samples, name, operation=operation, point=point)

    commits = "recoverypoint_phase_commits_total"
    # ride_created: each new key's claim; finished: k1, k2, k3, k4 (takeover), k5 (completer)
    assert by_point(commits, "ride_created") == 5
    assert by_point(commits, "finished") == 5
    # b2's first phase committed with its claim; its second ran out of retries.
    assert by_point(commits, "prepared", BUMP) == 2
    assert by_point(commits, "bumped", BUMP) == 1
    phase_count = "recoverypoint_phase_duration_seconds_count"
    # charge_created succeeded for k1, k2's retry, k3, k4 twice, k5's first request
    assert by_point(phase_count, "charge_created") == 6
    assert by_point(phase_count, "finished") == 5
    assert by_point("recoverypoint_foreign_step_errors_total", "charge_created") == 1

    assert value(samples, "recoverypoint_serialization_retries_total") == 2
    assert value(samples, "recoverypoint_serialization_retries_exhausted_total") == 1

    finished = "recoverypoint_finished_keys_total"
    assert value(samples, finished, operation=RIDES, by="client") == 4  # k1, k2, k3, k4
    assert value(samples, finished, operation=RIDES, by="completer") == 1  # k5
    assert value(samples, finished, operation=BUMP, by="client") == 1
    runs = "recoverypoint_completer_runs_total"
    assert value(samples, runs, operation=RIDES, outcome="resumed") == 1
    assert value(samples, "recoverypoint_abandoned_keys_total", operation=RIDES) == 1

    assert value(samples, "recoverypoint_jobs_staged_total", job=JOB) == 5
    assert value(samples, "recoverypoint_jobs_published_total", job=JOB) == 5
    assert value(samples, "recoverypoint_job_publish_errors_total", job=JOB) == 1
    assert value(samples, "recoverypoint_job_publish_lag_seconds_count", job=JOB) == 5
    lag = value(samples, "recoverypoint_job_publish_lag_seconds_sum", job=JOB)
    assert 0 < lag < 60
    consumed = "recoverypoint_consume_once_total"
    assert value(samples, consumed, job=JOB, outcome="processed") == 5
    assert value(samples, consumed, job=JOB, outcome="duplicate") == 1

    reaped_keys = "recoverypoint_reaped_keys_total"
    assert value(samples, reaped_keys, outcome="finished") == 6
    assert value(samples, reaped_keys, outcome="abandoned") == 0
    assert value(samples, "recoverypoint_reaped_messages_total") == 5
    for worker in ("completer", "enqueuer", "reaper"):
        last = value(samples, "recoverypoint_worker_last_pass_timestamp_seconds", worker=worker)
        assert before - 120 < last <= before

    # The gauges, read from the database at this scrape.
    assert value(samples, "recoverypoint_collector_up") == 1

    def gauge(name: str, operation: str = RIDES) -> float:
        return value(samples, f"recoverypoint_{name}", operation=operation)

    assert gauge("keys_stuck") == 1
    assert gauge("keys_in_flight") == 1
    assert gauge("keys_unfinished") == 3
    assert gauge("keys_abandoned") == 1
    assert 7200 <= gauge("oldest_unfinished_key_age_seconds") < 7200 + 120
    assert gauge("keys_unfinished", BUMP) == 1  # b2, waiting for its next attempt
    for name in ("keys_stuck", "keys_in_flight", "keys_abandoned"):
        assert gauge(name, BUMP) == 0  # every registered operation has a series
    assert 0 < gauge("oldest_unfinished_key_age_seconds", BUMP) < 120
    assert value(samples, "recoverypoint_staged_jobs") == 2
    assert value(samples, "recoverypoint_failing_staged_jobs") == 1
    assert 90 <= value(samples, "recoverypoint_oldest_staged_job_age_seconds") < 90 + 120
    assert rows(worker_db, "SELECT id FROM idempotency_keys WHERE abandoned_at IS NOT NULL") == [
        (abandoned_id,)
    ]
    # Never a key or a scope in a label.
    labels = {v for _, pairs in samples for _, v in pairs}
    assert not labels & {"k1", "k2", "k3", "k4", "k5", "b1", "b2", "s"}


@pytest.mark.slow
def test_the_collector_reports_down_instead_of_failing_the_scrape(
    served: tuple[CollectorRegistry, str],
) -> None:
    registry, url = served
    nowhere = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    registry.register(DatabaseCollector(nowhere))
    samples = scrape(url)
    assert value(samples, "recoverypoint_collector_up") == 0
    nowhere.dispose()


@pytest.mark.slow
def test_recoverypoint_metrics_serve_serves_the_gauges(
    worker_db: sa.Engine, worker_database_url: str
) -> None:
    plant_keys(worker_db, "served", 2, locked_at="now()", lock_token="gen_random_uuid()")
    plain_url = worker_database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recoverypoint",
            "metrics",
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--database-url",
            plain_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None
            line = server.stdout.readline()  # "serving metrics on http://127.0.0.1:PORT/metrics"
            samples = scrape(line.split()[-1])
            assert value(samples, "recoverypoint_keys_in_flight", operation="served") == 2
            assert value(samples, "recoverypoint_collector_up") == 1
        finally:
            server.terminate()  # SIGTERM: a clean stop
            _, errors = server.communicate(timeout=10)
        assert server.returncode == 0, errors


@pytest.mark.slow
def test_importing_recoverypoint_imports_neither_extra() -> None:
    code = (
        "import sys, recoverypoint, recoverypoint.workers, recoverypoint.jobs, "
        "recoverypoint.observe, recoverypoint.cli\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in "
        "('prometheus_client', 'opentelemetry')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_an_operation_met_once_keeps_its_series_at_zero(
    served: tuple[CollectorRegistry, str], worker_db: sa.Engine
) -> None:
    registry, url = served
    registry.register(DatabaseCollector(worker_db))  # no operation told: as metrics serve
    [key_id] = plant_keys(
        worker_db, "vanishing", 1, locked_at="now()", lock_token="gen_random_uuid()"
    )
    samples = scrape(url)
    assert value(samples, "recoverypoint_keys_in_flight", operation="vanishing") == 1
    with worker_db.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE id = :id"), {"id": key_id})
    samples = scrape(url)
    for name in ("in_flight", "unfinished", "stuck", "abandoned"):
        assert value(samples, f"recoverypoint_keys_{name}", operation="vanishing") == 0


def test_the_readmes_metrics_route_answers_at_metrics(worker_db: sa.Engine) -> None:
    from console_site import TestClient  # imported there without Starlette's warning
    from fastapi import FastAPI

    from recoverypoint.integrations.prometheus import MetricsApp

    registry = CollectorRegistry()
    engine = rp.Engine(worker_db, observer=PrometheusObserver(registry))
    registry.register(DatabaseCollector(engine.db, engine.operations))
    app = FastAPI()
    app.add_route("/metrics", MetricsApp(registry))
    with TestClient(app, follow_redirects=False) as scraper:
        answer = scraper.get("/metrics")
        assert answer.status_code == 200, answer.headers
        assert "recoverypoint_collector_up 1.0" in answer.text
