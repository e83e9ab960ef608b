"""docs/how-to/idempotent.md run word for word: its four examples execute as
written against a real database, the payment API of ``idempotent_payments`` on loopback,
and (the Celery task) a real Celery worker on RabbitMQ."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import sqlalchemy as sa
from docs_snippets import blocks, page
from idempotent_payments import Payments, payments_api

# Long enough for a worker on a machine busy with other suites; a worker that takes longer
# has hung.
HUNG_WORKER = 600


def examples() -> list[str]:
    """The page's four examples: the Celery task, the async payment, the agent's tool, the
    lookup with an optional key that counts its replays."""
    found = [
        b.body
        for b in blocks(page("how-to/idempotent.md"))
        if b.mark_value == "tests/test_idempotent_readme.py"
    ]
    assert len(found) == 4
    return found


@pytest.fixture
def payments(monkeypatch: pytest.MonkeyPatch, database_url: str) -> Iterator[tuple[Payments, str]]:
    with payments_api() as (api, url):
        monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)
        monkeypatch.setenv("PAYMENTS_URL", url)
        yield api, url


def key_rows(db: sa.Engine, operation: str) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT scope, idempotency_key, response_status, response_body "
                    "FROM idempotency_keys WHERE operation = :o"
                ),
                {"o": operation},
            )
        )


def test_the_async_payment_example(
    payments: tuple[Payments, str], db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    api, _ = payments
    exec(compile(examples()[1], "how-to/idempotent.md", "exec"), {"__name__": "readme_async"})
    assert capsys.readouterr().out == "order 42 was already paid with another amount\n"
    [row] = key_rows(db, "process_payment")
    assert (row.idempotency_key, row.response_status) == ("order:42", 200)
    assert list(api.calls.values()) == [1]  # one charge request for the two calls


def test_the_agent_tool_example(
    payments: tuple[Payments, str], db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {"__name__": "readme_tool"}
    exec(compile(examples()[2], "how-to/idempotent.md", "exec"), namespace)
    assert capsys.readouterr().out == "sent to ada@example.com\nsent to ada@example.com\n"
    [row] = key_rows(db, "tools.send_email")
    assert (row.scope, row.idempotency_key) == ("conv_17", "call_8f2e")
    namespace["engine"].dispose()


def test_the_optional_key_and_replay_hook_example(
    payments: tuple[Payments, str], db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="recoverypoint"):
        namespace: dict[str, Any] = {"__name__": "readme_reserve"}
        exec(compile(examples()[3], "how-to/idempotent.md", "exec"), namespace)
    [row] = key_rows(db, "stock.reserve")
    assert (row.idempotency_key, row.response_body) == ("r-1", 1)
    unprotected = [r for r in caplog.records if getattr(r, "idempotency", None) == "unprotected"]
    assert len(unprotected) == 1


@pytest.mark.slow
def test_the_celery_example_charges_once_for_a_message_delivered_twice(
    payments: tuple[Payments, str], db: sa.Engine
) -> None:
    api, _ = payments
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "tasks.py").write_text(examples()[0])
        sys.path.insert(0, directory)
        try:
            import tasks  # type: ignore[import-not-found]
        finally:
            sys.path.remove(directory)
        try:
            with tasks.app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, timeout=5)
        except Exception as exc:
            if os.environ.get("RECOVERYPOINT_REQUIRE_SERVICES") == "1":
                pytest.fail(f"no RabbitMQ ({exc}); RECOVERYPOINT_REQUIRE_SERVICES=1 requires it")
            pytest.skip(f"no RabbitMQ ({exc})")
        queue = f"readme-{os.getpid()}-{time.monotonic_ns()}"
        tasks.app.conf.task_default_queue = queue  # this test's own queue
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--queues", queue, "--loglevel", "INFO"],
            cwd=directory,
            env=dict(os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        # The worker's log says when each message was handled ("succeeded", or "raised"
        # for a failure): the test waits for those two lines, however long a busy machine
        # takes to start the worker. The bound is only there so that a worker that hangs
        # fails the test instead of the whole run.
        lines: list[str] = []
        handled = threading.Event()

        def follow(stdout: IO[str]) -> None:
            for line in stdout:
                lines.append(line)
                if sum("succeeded" in seen or " raised " in seen for seen in lines) >= 2:
                    handled.set()

        assert worker.stdout is not None
        reader = threading.Thread(target=follow, args=(worker.stdout,), daemon=True)
        reader.start()
        try:
            tasks.charge_order.delay("order-7", 2000)
            tasks.charge_order.delay("order-7", 2000)  # the same message again
            assert handled.wait(timeout=HUNG_WORKER), "".join(lines)
        finally:
            worker.terminate()  # a warm shutdown: the task under way finishes first
            worker.wait()
            reader.join()
            worker.stdout.close()
            with tasks.app.connection_for_write() as connection:
                connection.default_channel.queue_delete(queue)
            tasks.engine.dispose()
            sys.modules.pop("tasks", None)
        log = "".join(lines)
    [row] = key_rows(db, "tasks.charge_order")
    assert row.response_body["order_id"] == "order-7", log
    assert list(api.calls.values()) == [1], log
    assert log.count("succeeded") == 2, log
