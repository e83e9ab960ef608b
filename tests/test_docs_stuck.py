"""docs/how-to/operating.md, "When a key is stuck", walked through word for word on a real
database: every ``recoverypoint`` command of the section runs as written (the worker in a
process of its own, as a reader runs it), and every line of output the section shows is
printed (times, downstream keys and charge ids aside, which differ by run).

The key is made stuck as a real failure leaves it: an engine whose foreign step fails
runs it three times; then time passes (it was created 14 minutes ago and its next attempt
is 12 minutes overdue), but its last attempt is recent, as when its client (or the
operator) just tried it: the worker command, at its default --min-age, must take it all
the same, as the operator retried it.
``myapp.recovery:engine`` is the fixed engine, the one deployed after the fix.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from docs_snippets import section

import recoverypoint as rp
from recoverypoint.cli import main

pytestmark = pytest.mark.slow  # the page's commands as subprocesses

PAGE = "how-to/operating.md"
WORKER = "recoverypoint worker completer --once --app myapp.recovery:engine"


def blocks() -> list[tuple[str, list[str]]]:
    """The section's blocks: ``("bash", commands)`` or ``("", output lines)``."""
    found = section(PAGE, "When a key is stuck")
    assert all(b.mark == "test" and b.mark_value == "tests/test_docs_stuck.py" for b in found)
    return [(b.lang, b.body.rstrip("\n").split("\n")) for b in found]


# The fixed engine, as the worker's process imports it.
RECOVERY = """
import os

import recoverypoint as rp
from test_docs_stuck import ride

engine = rp.Engine(os.environ["RECOVERYPOINT_DATABASE_URL"])
engine.register(ride(payments_down=False))
"""


def ride(*, payments_down: bool) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("create_ride")

    @op.atomic_phase("ride_created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        tx.state["ride_id"] = 7

    @op.foreign_step("charge_created")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        if payments_down:
            raise RuntimeError("payments API down")
        return {"charge_id": "ch_" + step.downstream_key()[3:11]}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
        return rp.Response(
            201, {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
        )

    return op


_VARIES = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"), "<time>"),
    (re.compile(r"rp_[0-9a-f]{64}"), "<downstream key>"),
    (re.compile(r"ch_[0-9a-f]{8}"), "<charge>"),
    (re.compile(r"…#[0-9a-f]{10}"), "…#<masked>"),
]


def normal(line: str) -> str:
    for pattern, placeholder in _VARIES:
        line = pattern.sub(placeholder, line)
    return line.rstrip()


def test_the_stuck_key_section_works_as_written(
    worker_db: sa.Engine,
    worker_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    broken = rp.Engine(worker_db)
    broken.register(ride(payments_down=True))
    for _ in range(3):  # the client's attempts
        with pytest.raises(RuntimeError, match="payments API down"):
            broken.run(broken.operation("create_ride", 1), key="ride-0001", scope="user_42",
                       params={"origin": "SF", "target": "Oakland"},
                       request=rp.Request("POST", "/rides"))  # fmt: skip
    with worker_db.begin() as conn:
        conn.execute(sa.text(
            "UPDATE idempotency_keys SET created_at = now() - interval '14 minutes', "
            "last_run_at = now() - interval '5 seconds', "
            "next_attempt_at = now() - interval '12 minutes' RETURNING id"
        )).one()  # fmt: skip
    fixed = rp.Engine(worker_db)
    fixed.register(ride(payments_down=False))
    module = types.ModuleType("myapp.recovery")
    module.engine = fixed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys_modules(), "myapp", types.ModuleType("myapp"))
    monkeypatch.setitem(sys_modules(), "myapp.recovery", module)
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", worker_database_url)
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "recovery.py").write_text(RECOVERY)
    capsys.readouterr()

    ran = []
    printed = ""
    for lang, lines in blocks():
        if lang == "bash":
            printed = ""
            for command in lines:
                assert command.startswith("recoverypoint "), command
                ran.append(command)
                if command.startswith("recoverypoint worker"):
                    # A worker configures its process's logging as a service's: a process
                    # of its own, as the reader's.
                    worker = subprocess.run(
                        [sys.executable, "-m", "recoverypoint", *shlex.split(command)[1:]],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
                    )  # fmt: skip
                    assert worker.returncode == 0, worker.stderr
                    assert "finished=1" in worker.stderr, worker.stderr
                    continue
                assert main(shlex.split(command)[1:]) == 0, command
                printed += capsys.readouterr().out
        else:
            shown = [normal(line) for line in lines if line.strip() != "…"]
            actual = {normal(line) for line in printed.splitlines()}
            missing = [line for line in shown if line not in actual]
            assert not missing, f"after {ran[-1]!r}, not printed: {missing}\n{printed}"

    assert ran == [
        "recoverypoint keys list --state stuck",
        "recoverypoint keys show 1 --app myapp.recovery:engine",
        "recoverypoint keys retry 1",
        WORKER,
        "recoverypoint keys show 1 --reveal",
    ]
    with worker_db.connect() as conn:
        status = conn.execute(sa.text("SELECT response_status FROM idempotency_keys")).scalar()
    assert status == 201


def sys_modules() -> dict[str, Any]:
    return sys.modules
