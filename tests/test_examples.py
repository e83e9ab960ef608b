"""examples/quickstart.py, run the one way the README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.slow  # the examples' commands as subprocesses

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m examples.quickstart"
RUN_IT = re.compile(r"[\w./]*python3? +(?:-m +)?examples[./]quickstart(?:\.py)?")


def test_the_pages_give_one_command_for_the_quickstart() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    said = {
        " ".join(found.split()).removeprefix(".venv/bin/")
        for page in pages
        for found in re.findall(
            r"[\w./]*python3? +(?:-m +)?examples[./]quickstart(?:\.py)?", page.read_text()
        )
    }
    assert said == {COMMAND}


def test_the_quickstart_runs(empty_database_url: str) -> None:
    done = subprocess.run(
        [sys.executable, *COMMAND.split()[1:], "--database-url", empty_database_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    db = sa.create_engine(empty_database_url)
    try:
        with db.connect() as conn:  # one ride, though its first attempt failed
            assert conn.scalar(sa.text("SELECT count(*) FROM rides")) == 1
    finally:
        db.dispose()
