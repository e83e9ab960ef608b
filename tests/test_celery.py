"""Celery on RabbitMQ as the job backend: a staged job reaches a real Celery worker, which
runs it once with consume_once although the message arrives twice.

Skipped when no broker answers on 127.0.0.1:5672, unless RECOVERYPOINT_REQUIRE_SERVICES=1
(as in CI), which turns a missing broker into a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from workload import JOB, Recorder, rows, steps_operation, wait_for

import recoverypoint as rp
from recoverypoint.jobs import Job
from recoverypoint.workers import Enqueuer

pytestmark = pytest.mark.slow  # RabbitMQ and a Celery worker process

TESTS = Path(__file__).resolve().parent
CELERY_WORKER = [
    sys.executable, "-m", "celery", "-A", "celery_app", "worker",
    "--pool", "solo", "--without-gossip", "--without-mingle", "--loglevel", "INFO",
]  # fmt: skip


@pytest.fixture
def celery_app() -> Iterator[Celery]:
    """The test's Celery app on a reachable RabbitMQ, its default queue of this test alone
    (deleted afterwards)."""
    from celery_app import BROKER_URL, make_app

    name = f"recoverypoint-test-{uuid.uuid4().hex}"
    app = make_app(name)
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:
        message = f"no RabbitMQ at {BROKER_URL} ({exc})"
        if os.environ.get("RECOVERYPOINT_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; RECOVERYPOINT_REQUIRE_SERVICES=1 requires it")
        pytest.skip(f"{message}; start it with `rabbitmq-server -detached`")
    yield app
    with app.connection_for_write() as connection:
        connection.default_channel.queue_delete(name)
    app.close()


def test_a_staged_job_reaches_a_celery_worker_and_runs_once_though_delivered_twice(
    worker_db: sa.Engine, worker_database_url: str, celery_app: Celery
) -> None:
    from recoverypoint.integrations.celery import CeleryBackend

    class LostConfirm(CeleryBackend):
        """Its first publish reaches the broker, then reports a failure (a confirm lost
        to a dropped connection, say): the job stays staged and goes out again."""

        lost = False

        def publish(self, job: Job) -> None:
            super().publish(job)
            if not self.lost:
                self.lost = True
                raise ConnectionError("connection dropped before the publish was confirmed")

    queue = celery_app.conf.task_default_queue
    engine = rp.Engine(worker_db, jobs=LostConfirm(celery_app, queue=queue))
    op = steps_operation("steps", Recorder(worker_db))
    engine.register(op)
    engine.run(op, key="order-1", params={}, scope="tenant-7")
    [job] = rows(worker_db, "SELECT job_name, job_key, job_args FROM staged_jobs")
    assert job.job_name == JOB

    env = {
        **os.environ,
        "RP_WORKER_TEST_DATABASE_URL": worker_database_url,
        "RP_CELERY_QUEUE": queue,
    }
    with tempfile.TemporaryFile("w+") as log:
        worker = subprocess.Popen(
            [*CELERY_WORKER, "--queues", queue],
            cwd=TESTS,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            enqueuer = Enqueuer(engine, retry_base=0.0)
            first = enqueuer.run_once()
            second = enqueuer.run_once()
            wait_for(lambda: len(rows(worker_db, "SELECT * FROM deliveries")) == 2)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
            log.seek(0)
            worker_log = log.read()

    assert (first.published, first.failed, second.published) == (0, 1, 1)
    assert rows(worker_db, "SELECT * FROM staged_jobs") == []
    deliveries = rows(worker_db, "SELECT message_id, ran FROM deliveries ORDER BY ran")
    assert deliveries == [(job.job_key, False), (job.job_key, True)], worker_log
    receipts = rows(worker_db, "SELECT message_id, key_id FROM receipts")
    assert receipts == [(job.job_key, job.job_args["key_id"])]
    # The scope travelled with the message: the record is in the job's scope (on Citus,
    # on the scope's worker, with the consumer's writes).
    processed = rows(worker_db, "SELECT consumer, message_id, scope FROM processed_messages")
    assert processed == [("notify", job.job_key, "tenant-7")]
    assert worker.returncode == 0, worker_log  # a warm shutdown on SIGTERM
