"""The asyncio application of the async worker tests: ``recoverypoint worker … --app
async_worker_app:engine`` (its ``rp.AsyncEngine`` alone) from the tests directory, and
``python async_worker_app.py KEY`` to send one request as a client that then goes away.

``sync_engine`` is the same application's ``rp.Engine``, for its sync routes, on the same
database.

Environment: ``RP_WORKER_TEST_DATABASE_URL`` (required); ``RP_PROVIDER_DOWN=1`` makes the
foreign step fail, as a payment provider that is down does (in that process only).
"""

from __future__ import annotations

import asyncio
import os
import sys

from workload import JOB, Recorder, async_steps_operation, steps_operation

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend, Job

ASYNC_OPERATION = "async_steps"
SYNC_OPERATION = "steps"

backend = InProcessBackend()
engine = rp.AsyncEngine(os.environ["RP_WORKER_TEST_DATABASE_URL"], jobs=backend)
recorder = Recorder(engine.db)
operation = async_steps_operation(
    ASYNC_OPERATION, recorder, provider_down=lambda: os.environ.get("RP_PROVIDER_DOWN") == "1"
)
engine.register(operation)

sync_engine = rp.Engine(os.environ["RP_WORKER_TEST_DATABASE_URL"])
sync_engine.register(steps_operation(SYNC_OPERATION, recorder))


@backend.handler(JOB)
def notify(job: Job) -> None:
    recorder.published(job)


async def request(key: str) -> int:
    try:
        outcome = await engine.run(operation, key=key, params={}, scope="async-app")
        return outcome.status
    finally:
        await engine.dispose()


if __name__ == "__main__":
    print(asyncio.run(request(sys.argv[1])))
