"""The engine Rocket Rides' workers run, with the receipt consumer as its job backend.

From the repository root, with the same settings as the API::

    export RECOVERYPOINT_DATABASE_URL=postgresql://…   ROCKET_RIDES_PROVIDER_URL=http://127.0.0.1:8001
    recoverypoint worker completer --app recoverypoint.demo.rocket_rides.workers:engine
    recoverypoint worker enqueuer --app recoverypoint.demo.rocket_rides.workers:engine

For an API run with ``--async``, the workers take ``workers:async_engine`` instead: the
same operation with ``async def`` phases, on ``rp.AsyncEngine``.

``ROCKET_RIDES_LOCK_TIMEOUT`` (seconds, default 90) must equal the API's ``--lock-timeout``:
the completer takes over a key once that lease has expired.

Receipts are sent in the enqueuer's process (:class:`~recoverypoint.jobs.InProcessBackend`).
Delivery is at least once, so every delivery is logged in ``receipt_deliveries`` with the
enqueuer's pid, and :func:`~recoverypoint.jobs.consume_once` makes sure each receipt is
sent (a row in ``receipts``, standing for an email) once, in the same transaction.
"""

from __future__ import annotations

import os
from datetime import timedelta

import httpx

import recoverypoint as rp
from recoverypoint.database import DATABASE_URL_ENV
from recoverypoint.jobs import InProcessBackend, Job

from . import receipts as receipt_consumer
from .api import async_ride_operation, ride_operation

PROVIDER_URL_ENV = "ROCKET_RIDES_PROVIDER_URL"
LOCK_TIMEOUT_ENV = "ROCKET_RIDES_LOCK_TIMEOUT"
RECEIPT_JOB = receipt_consumer.RECEIPT_JOB

missing = [name for name in (DATABASE_URL_ENV, PROVIDER_URL_ENV) if not os.environ.get(name)]
if missing:
    # An ImportError, so that `recoverypoint worker --app` reports it in one line.
    raise ImportError(f"set {' and '.join(missing)} to run Rocket Rides' workers")

receipts = InProcessBackend()
# A ride is short-lived: its completer retries come within seconds, not hours.
url, retry_base, retry_cap = os.environ[DATABASE_URL_ENV], 1.0, 30.0
engine = rp.Engine(url, jobs=receipts, retry_base=retry_base, retry_cap=retry_cap)
async_engine = rp.AsyncEngine(url, jobs=receipts, retry_base=retry_base, retry_cap=retry_cap)
lock_timeout = timedelta(seconds=float(os.environ.get(LOCK_TIMEOUT_ENV, "90")))
provider_url, timeout = os.environ[PROVIDER_URL_ENV], 10.0
engine.register(ride_operation(httpx.Client(base_url=provider_url, timeout=timeout), lock_timeout))
async_engine.register(
    async_ride_operation(httpx.AsyncClient(base_url=provider_url, timeout=timeout), lock_timeout)
)


@receipts.handler(RECEIPT_JOB)
def send_ride_receipt(job: Job) -> None:
    receipt_consumer.send_ride_receipt(engine.db, job)
