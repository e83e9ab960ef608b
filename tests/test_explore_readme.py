"""docs/how-to/testing.md, "Prove your operation crash-safe": its operation (whose provider
ignores idempotency keys) and its subject, written as shown, give the report the page shows,
from the command line and from the pytest fixture; with the provider fixed, every schedule
passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_snippets import section

from recoverypoint.integrations.pytest_plugin import SERVER_URL_ENV

pytestmark = pytest.mark.slow  # pytest and the explorer as subprocesses

BLOCKS = [b.body for b in section("how-to/testing.md", "Prove your operation crash-safe")]

# The fix the page names: the provider answers a key it has seen with that key's first charge.
MISTAKE = """    with db.begin() as conn:
        return conn.scalar("""
FIXED = """    with db.begin() as conn:
        conn.execute(sa.text("LOCK TABLE charges"))
        first = conn.scalar(
            sa.text("SELECT id FROM charges WHERE idempotency_key = :k"), {"k": idempotency_key}
        )
        if first is not None:
            return first
        return conn.scalar("""


def write_app(root: Path, fixed: bool = False) -> None:
    (root / "myapp").mkdir()
    (root / "myapp" / "__init__.py").write_text("")
    checkout = next(b for b in BLOCKS if b.startswith("# myapp/checkout.py"))
    if fixed:
        assert checkout.count(MISTAKE) == 1
        checkout = checkout.replace(MISTAKE, FIXED)
    (root / "myapp" / "checkout.py").write_text(checkout)
    subject = next(b for b in BLOCKS if b.startswith("# myapp/crash_safety.py"))
    (root / "myapp" / "crash_safety.py").write_text(subject)


def shown_lines(block: str) -> list[str]:
    """The report's lines the page shows whole: not those with a shortened key, the
    timing, or the hint, which the page wraps."""
    hint = ("why:", "provider acted twice", "key (see")
    return [
        line.strip()
        for line in block.splitlines()
        if line.strip() and "…" not in line and "s)" not in line and not line.startswith(hint)
    ]


def run_command(server_url: str, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The page's command, on the test's server, in ``root``."""
    command = next(b for b in BLOCKS if b.startswith("$ recoverypoint explore"))
    argv = command.removeprefix("$ ").split()
    argv[argv.index("--database-url") + 1] = server_url
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", *argv[1:], *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=root,
    )


def test_the_command_gives_the_report_shown(server_url: str, tmp_path: Path) -> None:
    write_app(tmp_path)
    ran = run_command(server_url, tmp_path)

    assert ran.returncode == 1, ran.stdout + ran.stderr
    report = next(b for b in BLOCKS if b.startswith("crashes  schedules"))
    got = [line.strip() for line in ran.stdout.splitlines()]
    shown = shown_lines(report)
    assert len(shown) > 12
    for line in shown:
        assert line in got, f"{line!r} not in:\n{ran.stdout}"
    assert "the provider is where the guarantee ends" in ran.stdout


def test_the_fixture_fails_the_test_as_shown(server_url: str, tmp_path: Path) -> None:
    write_app(tmp_path)
    test = next(b for b in BLOCKS if "def test_checkout_is_crash_safe" in b)
    (tmp_path / "test_checkout.py").write_text(test)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_checkout.py"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        # The plugin's rp_server_url: the server the README's user names.
        env={**os.environ, "PYTHONPATH": str(tmp_path), SERVER_URL_ENV: server_url},
    )

    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "smallest failing schedule: client: attempt 1 raises at after_foreign:charged" in (
        ran.stdout
    )


def test_the_fixed_provider_passes(server_url: str, tmp_path: Path) -> None:
    """The fix the page names: every schedule of one crash passes (the deeper ones are
    Rocket Rides' test's to run)."""
    write_app(tmp_path, fixed=True)
    ran = run_command(server_url, tmp_path, "--depth", "1")

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "checkout: every invariant held in 45 schedules (depth 1)" in ran.stdout
