"""docs/how-to/testing.md, "Fault injection in your own tests": its test file, written as
shown, passes under pytest against a migrated database, and passes again when run a second
time against the same database (its keys are its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from docs_snippets import section


def test_the_test_file_passes_twice(database_url: str, tmp_path: Path) -> None:
    [block] = [
        b
        for b in section("how-to/testing.md", "Fault injection in your own tests")
        if b.mark_value == "tests/test_docs_testing.py"
    ]
    assert block.file_name == "test_rides.py"
    (tmp_path / block.file_name).write_text(block.body)
    env = {**os.environ, "RECOVERYPOINT_DATABASE_URL": database_url}
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", block.file_name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"run {run}:\n{done.stdout}{done.stderr}"
        assert "1 passed" in done.stdout, done.stdout
