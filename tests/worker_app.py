"""The engine the worker tests' subprocesses run: ``recoverypoint worker … --app
worker_app:engine`` from the tests directory.

Environment: ``RP_WORKER_TEST_DATABASE_URL`` (required); ``RP_WORKER_TEST_PUBLISH_DELAY``,
seconds each publish takes, to make a batch long enough to interrupt.
"""

from __future__ import annotations

import os
import time

from workload import JOB, Recorder, steps_operation

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend, Job

backend = InProcessBackend()
engine = rp.Engine(os.environ["RP_WORKER_TEST_DATABASE_URL"], jobs=backend)
recorder = Recorder(engine.db)
engine.register(steps_operation("steps", recorder))
publish_delay = float(os.environ.get("RP_WORKER_TEST_PUBLISH_DELAY", "0"))


@backend.handler(JOB)
def notify(job: Job) -> None:
    recorder.published(job)
    time.sleep(publish_delay)
