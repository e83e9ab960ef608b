"""Celery as the enqueuer's job backend (``pip install 'recoverypoint[celery]'``).

Each staged job becomes ``app.send_task(job_name, kwargs=job_args, task_id=job_key)``: the
task is looked up by name on the worker side, so the enqueuer needs no import of your
tasks. The job's ``job_key`` travels as the task id, its scope and trace context as message
headers; :func:`job_of` reads them back in the task, for consumers to dedupe on::

    @app.task(bind=True, name="send_ride_receipt", acks_late=True)
    def send_ride_receipt(self, ride_id: int) -> None:
        job = job_of(self)
        with db.begin() as conn:
            if consume_once(conn, "send_ride_receipt", job.job_key, scope=job.scope):
                ...  # the work, committed with the consume-once record

For at-least-once delivery through RabbitMQ, turn publisher confirms on, so that a publish
returns only once the broker has the message (else a broker crash right after it could
lose a job the enqueuer already deleted)::

    app.conf.broker_transport_options = {"confirm_publish": True}

A publish that fails (broker down, confirm refused) raises, and the job stays staged and
is retried with backoff.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..jobs import Job

if TYPE_CHECKING:
    from celery import Celery, Task  # type: ignore[import-untyped]

# Message headers, which Celery hands a bound task as attributes of ``self.request``.
SCOPE_HEADER = "recoverypoint_scope"
TRACE_HEADER = "recoverypoint_traceparent"


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
        headers = {SCOPE_HEADER: job.scope}
        if job.trace_context is not None:
            headers[TRACE_HEADER] = job.trace_context
        # add_to_parent=False: an enqueuer that runs inside a task must not tie the jobs'
        # results to that task.
        self.app.send_task(
            job.name,
            kwargs=job.args,
            task_id=job.job_key,
            headers=headers,
            add_to_parent=False,
            **options,
        )


def job_of(task: Task) -> Job:
    """The job a bound task (``@app.task(bind=True)``) is running, as :class:`CeleryBackend`
    published it: ``job_key`` (the task id), ``scope`` and ``trace_context`` to hand to
    :func:`~recoverypoint.jobs.consume_once`. A task sent by other means than the enqueuer
    gets its task id and an empty scope."""
    request: Any = task.request
    return Job(
        name=task.name,
        args=dict(request.kwargs or {}),
        job_key=request.id,
        trace_context=request.get(TRACE_HEADER),
        scope=request.get(SCOPE_HEADER) or "",
    )
