"""benchmarks/ run on their own, outside the suite, and import from each other and from the
library's internals: a name renamed in one script broke another (``server_instructions.py``
asked ``instructions.py`` for a function it no longer had) and nothing noticed until the
script was run. Type-checked here instead, as ``src/`` is, without running them (they need
the bench extra, which the tests do not install: its packages are then unknown to mypy, as
pyproject.toml's overrides allow, and everything else is checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.mark.slow
def test_the_benchmarks_type_check(tmp_path: Path) -> None:
    # As the scripts run: each imports the others by their bare names (``import facts``) and
    # tests/ports.py; on Python 3.11 or newer (asyncio.Runner). A cache of its own: none
    # shared with another mypy run.
    scripts = [str(path) for path in sorted(BENCHMARKS.glob("*.py"))]
    options = ["--python-version", "3.11", "--cache-dir", str(tmp_path)]
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", *options, *scripts],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": f"{BENCHMARKS}{os.pathsep}{ROOT / 'tests'}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
