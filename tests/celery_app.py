"""The Celery side of the Celery test: ``celery -A celery_app worker`` from the tests
directory runs :func:`notify`, the consumer of the jobs ``workload.steps_operation`` stages.

Environment: ``RP_WORKER_TEST_DATABASE_URL`` (the consumer's database), ``RP_CELERY_QUEUE``
(one per test run) and ``RP_CELERY_BROKER_URL``.
"""

from __future__ import annotations

import functools
import os

import sqlalchemy as sa
from celery import Celery
from workload import JOB

from recoverypoint.database import create_engine
from recoverypoint.integrations.celery import job_of
from recoverypoint.jobs import consume_once

BROKER_URL = os.environ.get("RP_CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def make_app(queue: str) -> Celery:
    app = Celery("recoverypoint_test", broker=BROKER_URL)
    app.conf.update(
        task_default_queue=queue,
        # A publish returns once RabbitMQ has the message: what at-least-once needs.
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
    )
    return app


app = make_app(os.environ.get("RP_CELERY_QUEUE", "recoverypoint-test"))


@functools.cache
def database() -> sa.Engine:
    return create_engine(os.environ["RP_WORKER_TEST_DATABASE_URL"])


@app.task(bind=True, name=JOB)
def notify(self: object, key_id: int) -> None:
    job = job_of(self)
    message_id = job.job_key
    with database().begin() as conn:
        ran = consume_once(conn, "notify", message_id, scope=job.scope)
        if ran:
            conn.execute(
                sa.text("INSERT INTO receipts (message_id, key_id) VALUES (:m, :k)"),
                {"m": message_id, "k": key_id},
            )
    # Every delivery, after its transaction: the test waits for these.
    with database().begin() as conn:
        conn.execute(
            sa.text("INSERT INTO deliveries (message_id, ran) VALUES (:m, :r)"),
            {"m": message_id, "r": ran},
        )
