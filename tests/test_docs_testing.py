"""docs/how-to/testing.md, "Fault injection in your own tests": its test file, written as
shown, passes under the page's pytest command with the plugin's fixtures, and passes again
when run a second time (each run has its own database, each test its own key)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_snippets import section
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.slow  # pytest run twice on the page's test file

DOC_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def test_the_test_file_passes_twice(server_url: str, tmp_path: Path) -> None:
    test_file, command = [
        b
        for b in section("how-to/testing.md", "Fault injection in your own tests")
        if b.mark_value == "tests/test_docs_testing.py"
    ]
    assert test_file.file_name == "test_rides.py"
    (tmp_path / test_file.file_name).write_text(test_file.body)
    assignment, *argv = shlex.split(command.body)
    name, value = assignment.split("=", 1)
    assert (name, value, argv) == (
        "RECOVERYPOINT_TEST_DATABASE_URL",
        DOC_SERVER,
        ["pytest", "test_rides.py"],
    )
    server = make_url(server_url).set(drivername="postgresql").render_as_string(hide_password=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERYPOINT_")}
    env[name] = server  # the test's server, wherever it is
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for run in (1, 2):
        done = subprocess.run(
            [*argv, "-p", "no:cacheprovider"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"run {run}:\n{done.stdout}{done.stderr}"
        assert "1 passed" in done.stdout, done.stdout
