"""Celery as the enqueuer's job backend (``pip install 'recoverypoint[celery]'``).

Each staged job becomes ``app.send_task(job_name, kwargs=job_args, task_id=job_key)``: the
task is looked up by name on the worker side, so the enqueuer needs no import of your
tasks, and the job's ``job_key`` travels as the task id. Consumers dedupe on it::

    @app.task(bind=True, name="send_ride_receipt", acks_late=True)
    def send_ride_receipt(self, ride_id: int) -> None:
        with db.begin() as conn:
            if consume_once(conn, "send_ride_receipt", self.request.id):
                ...  # the work, committed with the consume-once record

For at-least-once delivery through RabbitMQ, turn publisher confirms on, so that a publish
returns only once the broker has the message (else a broker crash right after it could
lose a job the enqueuer already deleted)::

    app.conf.broker_transport_options = {"confirm_publish": True}

A publish that fails (broker down, confirm refused) raises, and the job stays staged and
is retried with backoff.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..jobs import Job

if TYPE_CHECKING:
    from celery import Celery  # type: ignore[import-untyped]


class CeleryBackend:
    """Publishes jobs through a Celery app, by task name.

    Parameters
    ----------
    app:
        Your :class:`celery.Celery` application; its broker and routing apply.
    queue:
        Send every job to this queue instead of the one the app's routing picks.
    """

    def __init__(self, app: Celery, *, queue: str | None = None) -> None:
        self.app = app
        self.queue = queue

    def publish(self, job: Job) -> None:
        options = {} if self.queue is None else {"queue": self.queue}
        # add_to_parent=False: an enqueuer that runs inside a task must not tie the jobs'
        # results to that task.
        self.app.send_task(
            job.name, kwargs=job.args, task_id=job.job_key, add_to_parent=False, **options
        )
