"""Jobs after staging: the backends the enqueuer publishes to, and consume-once for consumers.

An atomic phase stages a job (:meth:`AtomicContext.stage_job`) in its own transaction; the
enqueuer (:mod:`recoverypoint.workers.enqueuer`) later hands it to the engine's
:class:`JobBackend`. Delivery is at least once: a job is published again when the
enqueuer stops between publishing it and committing its removal, or when a publish
reported failure after the broker had taken the message. Every message carries the job's
``job_key``, stable across all of that, so a consumer wraps its work in
:func:`consume_once` and runs it at most once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, text

from .observe import NO_OBSERVER, Observer, isolated

F = TypeVar("F", bound=Callable[["Job"], object])


@dataclass(frozen=True)
class Job:
    """A staged job as a backend receives it."""

    name: str
    args: dict[str, Any]
    job_key: str
    """Stable across retries and re-publishes: the message id consumers dedupe on."""
    trace_context: str | None = None
    """The W3C ``traceparent`` of the phase that staged the job, when the engine traces:
    hand it to :func:`consume_once` (a backend may carry it in the message) so that the
    consumer's span links to the request."""
    scope: str = ""
    """The scope of the request that staged the job: hand it to :func:`consume_once` (a
    backend may carry it in the message) so that, on Citus, the consumer's record commits
    on the scope's worker."""


class JobBackend(Protocol):
    """Where the enqueuer publishes jobs. ``publish`` returns once the job is handed over,
    and raises if it was not; the job then stays staged and is retried with backoff. A
    backend that knows the jobs it takes raises :class:`UnknownJob` for one it does not."""

    def publish(self, job: Job) -> None: ...


class UnknownJob(LookupError):
    """The backend has no handler for the job's name: its application does not register
    one, or the module that does was not imported. The enqueuer logs it as an error (once
    a batch, by name), counts it, and keeps the job staged, backed off, with this error as
    its ``last_error`` (``UnknownJob: ...``, which ``recoverypoint doctor`` and the console
    look for); ``recoverypoint worker --once`` then fails."""


class InProcessBackend:
    """Runs each job right away, in the enqueuer's process, by the handler registered for
    its name. For tests, scripts and small deployments without a broker.

    A handler that raises counts as a failed publish: the job stays staged and is tried
    again later.
    """

    def __init__(self, handlers: Mapping[str, Callable[[Job], object]] | None = None) -> None:
        self._handlers: dict[str, Callable[[Job], object]] = dict(handlers or {})

    def handler(self, name: str) -> Callable[[F], F]:
        """Decorator: run the decorated ``fn(job)`` for jobs named ``name``."""

        def register(fn: F) -> F:
            self._handlers[name] = fn
            return fn

        return register

    def publish(self, job: Job) -> None:
        try:
            handler = self._handlers[job.name]
        except KeyError:
            raise UnknownJob(
                f"no handler for job {job.name!r}; register one with @backend.handler({job.name!r})"
            ) from None
        handler(job)


# Inserted first in the consumer's transaction: a second delivery either finds the row
# (committed) or waits for the first delivery's transaction to end, then finds it or not.
# In the job's scope: one shard on Citus, co-located with the scope's rows. No conflict
# target: the key is (consumer, message_id) on one server, where the previous release's
# consumers still insert without a scope, and (consumer, message_id, scope) on Citus.
_MARK_PROCESSED = text(
    """
    INSERT INTO processed_messages (consumer, message_id, scope)
    VALUES (:consumer, :message_id, :scope)
    ON CONFLICT DO NOTHING
    RETURNING true
    """
)


def consume_once(
    connection: Connection,
    consumer: str,
    message_id: str,
    *,
    scope: str = "",
    observer: Observer = NO_OBSERVER,
    trace_context: str | None = None,
) -> bool:
    """Record that ``consumer`` processes ``message_id``; ``False`` if it already did.

    Call it first inside the transaction that does the message's work, and do the work
    only when it returns ``True``. The record commits with the work, or rolls back with it
    so that a redelivery can try again::

        with db.begin() as conn:
            if consume_once(conn, "send_receipt", job.job_key, scope=job.scope):
                send_receipt(conn, job.args)

    ``consumer`` names the piece of work: two consumers of one message each run once. The
    reaper deletes records older than its ``processed_retention``.

    ``scope``: the job's (:attr:`Job.scope`), stored with the record. On Citus the records
    are distributed by it, so that the record commits on the scope's worker together with
    the consumer's writes to that scope's rows (one worker, no two-phase commit). There a
    message is recognised only under the scope it was recorded with (on one server, under
    any): a consumer passes its jobs' scopes always or never (records written before
    migration 0014 have ``''``, as do those of a consumer that passes none).

    ``observer`` (e.g. ``engine.observer``) counts processed and duplicate messages and
    traces the call, linked to the request that staged the job by ``trace_context``
    (:attr:`Job.trace_context`); it is called in isolation, so its failures never undo
    the decision.
    """
    if not consumer or not message_id:
        raise ValueError("consume_once needs a consumer name and a message id")
    observer = isolated(observer)
    with observer.consuming(consumer, message_id, trace_context):
        processed = (
            connection.execute(
                _MARK_PROCESSED, {"consumer": consumer, "message_id": message_id, "scope": scope}
            ).first()
            is not None
        )
        observer.consumed(consumer, processed)
    return processed
