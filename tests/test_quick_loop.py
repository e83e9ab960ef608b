"""The quick loop of docs/contributing.md, the suite without its tests marked ``slow``, still
runs the engines, the HTTP integrations and the workers: a ``slow`` mark put on too much
would quietly leave them out of the loop contributors run after each edit."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from docs_snippets import section

ROOT = Path(__file__).resolve().parents[1]

# What the loop must cover, a module or two for each: the request path on both engines, the
# integrations over real HTTP (FastAPI, Flask, Django), the workers and their loop.
COVERED = [
    "tests/test_engine.py",
    "tests/test_engine_async.py",
    "tests/test_http.py",
    "tests/test_idempotent_fastapi.py",
    "tests/django_site/test_django_views.py",
    "tests/test_completer.py",
    "tests/test_enqueuer.py",
    "tests/test_worker_loop.py",
]


def quick_loop() -> list[str]:
    """The page's command, as its arguments to pytest."""
    (block,) = section("contributing.md", "The quick loop")
    (line,) = block.body.strip().split("\n")
    program, *args = shlex.split(line)
    assert program == ".venv/bin/pytest", line
    return args


def collected(*args: str) -> Counter[str]:
    """How many tests pytest collects with ``args``, by module."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED), done.stdout + done.stderr
    return Counter(
        found.group(1) for found in re.finditer(r"^(tests/[\w/]+\.py)::", done.stdout, re.M)
    )


@pytest.mark.slow
def test_the_quick_loop_leaves_out_the_slow_tests() -> None:
    assert collected(*quick_loop(), "tests/test_failover.py") == Counter()


@pytest.mark.slow
def test_the_quick_loop_runs_most_of_the_engines_integrations_and_workers_tests() -> None:
    everything = collected(*COVERED)
    quick = collected(*quick_loop(), *COVERED)
    assert set(everything) == set(COVERED), everything
    # Most, not all: a test of these modules that takes seconds may be left to the suite.
    short = {
        module: (quick[module], everything[module])
        for module in COVERED
        if quick[module] < everything[module] * 3 / 4
    }
    assert not short, f"the quick loop runs too few of these modules' tests: {short}"
