"""docs/how-to/async.md: its example runs word for word against a migrated database; so
do the two applications of docs/how-to/workers.md (Celery's, and the asyncio one), with
the page's worker command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from docs_snippets import Block, blocks, page
from workload import plant_keys, rows

pytestmark = pytest.mark.slow  # the workers' commands as subprocesses


def claimed(name: str) -> list[Block]:
    return [b for b in blocks(page(name)) if b.mark_value == "tests/test_async_readme.py"]


def test_the_async_example_runs_as_written(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    [example] = claimed("how-to/async.md")
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)
    exec(compile(example.body, example.where, "exec"), {"__name__": "docs_async"})


OPERATIONS = """
import recoverypoint as rp

orders = rp.Operation("place_order")


@orders.atomic_phase("order_placed")
async def place(tx: rp.AsyncAtomicContext, params: dict) -> None:
    tx.state["order_id"] = 1


@orders.foreign_step("confirmed")
async def confirm(step: rp.StepContext, params: dict) -> dict:
    return {"confirmation": step.downstream_key()}


@orders.atomic_phase("finished")
async def finish(tx: rp.AsyncAtomicContext, params: dict) -> rp.Response:
    return rp.Response(201, {"order_id": tx.state["order_id"]})
"""


SYNC_OPERATIONS = """
import recoverypoint as rp

rides = rp.Operation("create_ride")


@rides.atomic_phase("finished")
def finish(tx: rp.AtomicContext, params: dict) -> rp.Response:
    return rp.Response(201, {"order_id": 1})
"""

TASKS = """
from celery import Celery

celery_app = Celery("myapp", broker="amqp://guest:guest@127.0.0.1:5672//")
"""


@pytest.mark.parametrize("kind", ["celery", "asyncio"])
def test_the_workers_of_the_application_run_as_written(
    kind: str, worker_db: sa.Engine, worker_database_url: str, tmp_path: Path
) -> None:
    found = claimed("how-to/workers.md")
    assert [b.lang for b in found] == ["python", "python", ""]
    celery_recovery, async_recovery, command = (b.body for b in found)
    command = command.strip()
    recovery = celery_recovery if kind == "celery" else async_recovery
    operation = "create_ride" if kind == "celery" else "place_order"
    app = tmp_path / "myapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "operations.py").write_text(SYNC_OPERATIONS if kind == "celery" else OPERATIONS)
    (app / "tasks.py").write_text(TASKS)
    (app / "recovery.py").write_text(recovery)
    [key_id] = plant_keys(worker_db, operation, 1)

    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "recoverypoint",
            *shlex.split(command)[1:],
            "--once",
            "--min-age",
            "0",
        ],
        cwd=tmp_path,
        env={**os.environ, "RECOVERYPOINT_DATABASE_URL": worker_database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert worker.returncode == 0, worker.stderr
    done = "SELECT response_status, response_body FROM idempotency_keys WHERE id = :i"
    assert rows(worker_db, done, i=key_id) == [(201, {"order_id": 1})]
