"""Mutation testing with hand-written mutants, for what mutmut cannot mutate meaningfully
(the SQL in strings: mutmut only garbles a whole statement) or cannot reach (code that
tests run in subprocesses, which mutmut's per-process coverage does not see).

Each mutant is one exact replacement in one file of ``src/recoverypoint/``, applied to a
private copy of ``src/`` (the working tree is never touched, so others may go on editing
it), followed by the module's test subset, run with the copy first on ``PYTHONPATH``
(subprocesses the tests start inherit it). A mutant is killed when the tests fail and
survives when they pass; one whose ``old`` text is no longer in the file is reported stale.

    RECOVERYPOINT_TEST_DATABASE_URL=postgresql://... \\
    .venv/bin/python tools/mutate.py tools/mutants.toml [--only store.py] [--timeout 300]

The list (TOML): ``[[module]]`` with ``file`` and ``tests``, each with ``[[module.mutant]]``
entries of ``why``, ``old`` and ``new``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("src/recoverypoint")


@dataclass(frozen=True)
class Mutant:
    file: str
    why: str
    old: str
    new: str
    tests: tuple[str, ...]


def load(path: Path, only: str | None) -> list[Mutant]:
    modules = tomllib.loads(path.read_text())["module"]
    return [
        Mutant(module["file"], m["why"], m["old"], m["new"], tuple(module["tests"]))
        for module in modules
        if only is None or module["file"] == only
        for m in module["mutant"]
    ]


def run(mutant: Mutant, copy: Path, timeout: float) -> str:
    """``killed``, ``survived``, ``timeout``, ``stale`` or ``error`` (the tests did not run)."""
    target = copy / PACKAGE / mutant.file
    source = target.read_text()  # as copied when the run began: one consistent tree
    if source.count(mutant.old) != 1:
        return "stale"
    target.write_text(source.replace(mutant.old, mutant.new))
    try:
        outcomes = {"passed": "survived", "failed": "killed", "timeout": "timeout"}
        return outcomes.get(pytest(mutant.tests, copy, timeout), "error")
    finally:
        target.write_text(source)


def pytest(tests: tuple[str, ...], copy: Path, timeout: float) -> str:
    """``passed``, ``failed``, ``timeout`` or ``error``: the tests, on the copy's ``src``."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    # pytest: 0 all passed, 1 some failed; anything else means they did not run.
    return {0: "passed", 1: "failed"}.get(done.returncode, "error")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", type=Path)
    parser.add_argument("--only", metavar="FILE", help="one module, e.g. store.py")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS")
    args = parser.parse_args()
    mutants = load(args.mutants, args.only)
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="rp-mutants-") as tmp:
        copy = Path(tmp)
        # What the package finds beside itself: its migrations, and the demo's example.
        for part in ("src", "migrations", "examples"):
            shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        broken: set[tuple[str, ...]] = set()
        # A file may be listed twice, with other tests for some of its mutants: each
        # selection is checked once.
        for file, tests in {(m.file, m.tests) for m in mutants}:
            # Unmutated, the module's tests must pass, or no mutant says anything.
            if (baseline := pytest(tests, copy, args.timeout)) != "passed":
                print(f"{file}: the tests {baseline} without a mutant; skipped", flush=True)
                broken.add(tests)
        for mutant in (m for m in mutants if m.tests not in broken):
            began = time.monotonic()
            outcome = run(mutant, copy, args.timeout)
            results.setdefault(mutant.file, []).append(outcome)
            seconds = time.monotonic() - began
            print(f"{outcome:<8} {seconds:5.1f}s  {mutant.file}: {mutant.why}", flush=True)
    for file, outcomes in results.items():
        killed = sum(o in ("killed", "timeout") for o in outcomes)
        tested = sum(o != "stale" for o in outcomes)
        print(f"{file}: {killed}/{tested} killed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
