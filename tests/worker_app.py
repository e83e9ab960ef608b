"""The engine the worker tests' subprocesses run: ``recoverypoint worker … --app
worker_app:engine`` from the tests directory.

Environment: ``RP_WORKER_TEST_DATABASE_URL`` (required); ``RP_WORKER_TEST_PUBLISH_DELAY``,
seconds each publish takes, to make a batch long enough to interrupt;
``RP_WORKER_TEST_METRICS``, a file the process's Prometheus metrics are written to as it
exits.
"""

from __future__ import annotations

import atexit
import os
import time

from prometheus_client import CollectorRegistry, write_to_textfile
from workload import JOB, Recorder, steps_operation

import recoverypoint as rp
from recoverypoint.integrations.prometheus import PrometheusObserver
from recoverypoint.jobs import InProcessBackend, Job

registry = CollectorRegistry()
if metrics := os.environ.get("RP_WORKER_TEST_METRICS"):
    atexit.register(write_to_textfile, metrics, registry)
backend = InProcessBackend()
engine = rp.Engine(
    os.environ["RP_WORKER_TEST_DATABASE_URL"], jobs=backend, observer=PrometheusObserver(registry)
)
recorder = Recorder(engine.db)
engine.register(steps_operation("steps", recorder))
publish_delay = float(os.environ.get("RP_WORKER_TEST_PUBLISH_DELAY", "0"))


@backend.handler(JOB)
def notify(job: Job) -> None:
    recorder.published(job)
    time.sleep(publish_delay)
