"""recoverypoint as a user installs it: the wheel built from this checkout, installed with
its demo extra into a fresh virtualenv, run from a directory outside the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` directory of a fresh virtualenv with the wheel and its demo extra."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(where), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = where.glob("recoverypoint-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    bin_dir = where / "venv" / "bin"
    subprocess.run(
        [str(bin_dir / "pip"), "install", "-q", f"{wheel}[demo]"], check=True, capture_output=True
    )
    return bin_dir


def test_migrate_sql_piped_into_head_ends_quietly(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        f"'{installed / 'recoverypoint'}' migrate --sql | head -1",
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "BEGIN;\n", "")


def test_the_demo_runs_from_the_installed_package(
    installed: Path, tmp_path: Path, server_url: str
) -> None:
    done = subprocess.run(
        [
            str(installed / "recoverypoint"),
            "demo",
            "--requests",
            "20",
            "--database-url",
            server_url,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every invariant holds" in done.stdout
    assert str(ROOT) not in done.stdout + done.stderr  # nothing came from the checkout
