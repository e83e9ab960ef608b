"""consume_once: a handler's work runs at most once per consumer and message id, because
the record commits (or rolls back) with the work, in the consumer's own transaction."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from recoverypoint.jobs import InProcessBackend, Job, consume_once


class Handled(Exception):
    """Raised by a handler after its work, to roll it back."""


def deliver(db: sa.Engine, consumer: str, message_id: str, *, fail: bool = False) -> bool:
    """One delivery: True if the work ran (and committed, unless ``fail``)."""
    with db.begin() as conn:
        if not consume_once(conn, consumer, message_id):
            return False
        if fail:
            raise Handled
        return True


def test_the_work_runs_once_per_consumer_and_message(db: sa.Engine) -> None:
    message = uuid.uuid4().hex

    assert deliver(db, "receipts", message)
    assert not deliver(db, "receipts", message)  # a redelivery
    assert deliver(db, "analytics", message)  # another consumer of the same message
    assert deliver(db, "receipts", uuid.uuid4().hex)


def test_work_that_fails_rolls_its_record_back_so_a_redelivery_runs_it(db: sa.Engine) -> None:
    message = uuid.uuid4().hex

    with pytest.raises(Handled):
        deliver(db, "receipts", message, fail=True)

    assert deliver(db, "receipts", message)
    assert not deliver(db, "receipts", message)


def test_simultaneous_deliveries_run_the_work_once(db: sa.Engine) -> None:
    message = uuid.uuid4().hex
    start = threading.Barrier(8)

    def delivery(_: int) -> bool:
        start.wait()
        with db.begin() as conn:
            ran = consume_once(conn, "receipts", message)
            time.sleep(0.1)  # the work, while the others wait on the record
            return ran

    with ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(delivery, range(8))) == [False] * 7 + [True]


def test_in_process_backend_runs_the_handler_registered_by_name() -> None:
    backend = InProcessBackend()
    seen: list[Job] = []
    backend.handler("notify")(seen.append)
    job = Job("notify", {"n": 1}, "rp_key")

    backend.publish(job)

    assert seen == [job]
    with pytest.raises(LookupError, match="no handler for job 'other'"):
        backend.publish(Job("other", {}, "rp_other"))
