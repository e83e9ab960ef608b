"""The receipt consumer: each ``send_ride_receipt`` job is logged as delivered, and its
receipt sent once (:func:`~recoverypoint.jobs.consume_once`), in one transaction."""

from __future__ import annotations

import os

import sqlalchemy as sa

from recoverypoint.jobs import Job, consume_once

RECEIPT_JOB = "send_ride_receipt"

_DELIVERED = sa.text(
    "INSERT INTO receipt_deliveries (job_key, enqueuer_pid) VALUES (:job_key, :pid)"
)
_SEND = sa.text(
    "INSERT INTO receipts (job_key, ride_id, user_id, amount, currency) "
    "VALUES (:job_key, :ride_id, :user_id, :amount, :currency)"
)


def send_ride_receipt(db: sa.Engine, job: Job) -> None:
    with db.begin() as conn:
        conn.execute(_DELIVERED, {"job_key": job.job_key, "pid": os.getpid()})
        if consume_once(conn, RECEIPT_JOB, job.job_key, scope=job.scope):
            conn.execute(_SEND, {"job_key": job.job_key, **job.args})
