"""recoverypoint as a user installs it, by the commands of docs/install.md: the wheel built
from this checkout as the page builds it, installed with the page's extra into a fresh
virtualenv, and run from a directory outside the checkout; and the ``git+file://``
requirement the page shows, resolved and built by pip."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_snippets import section

pytestmark = [
    pytest.mark.slow,  # a wheel built and installed in a new virtualenv
    pytest.mark.xdist_group("wheel"),  # built once for the module
]

ROOT = Path(__file__).resolve().parents[1]
PAGE = "install.md"


def commands(heading: str) -> list[list[str]]:
    return [
        shlex.split(line)
        for block in section(PAGE, heading)
        if block.mark == "test"
        for line in block.body.strip().split("\n")
    ]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` directory of a fresh virtualenv where the page's install ran."""
    build, install, demo = commands("From a wheel")
    assert build == ["python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."]
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, *build[1:-2], str(where / "dist"), "."],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = (where / "dist").glob("recoverypoint-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    bin_dir = where / "venv" / "bin"
    assert install[:2] == ["pip", "install"] and install[2].startswith("dist/"), install
    shown, extras = install[2].removeprefix("dist/").split("[")
    assert shown == wheel.name, f"the page installs {shown}; the build made {wheel.name}"
    subprocess.run(
        [str(bin_dir / "pip"), "install", "-q", f"{wheel}[{extras}"],
        cwd=where,
        check=True,
        capture_output=True,
    )
    assert demo == ["recoverypoint", "demo"]
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
    # The page's `recoverypoint demo`, shortened, on the test server instead of an
    # embedded one (the demo's embedded server is tested in test_chaos.py).
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


def test_the_git_requirement_builds(tmp_path: Path) -> None:
    """The page's ``git+file://`` line, pointed at this repository: pip clones it and
    builds the wheel (installing that wheel is the test above)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: there is no repository to install from")
    [[pip, install, requirement]] = commands("From git")
    assert (pip, install) == ("pip", "install")
    name, url = requirement.split(" @ ")
    assert name == "recoverypoint[fastapi]"
    assert url == "git+file://localhost/path/to/recoverypoint"
    here = url.replace("/path/to/recoverypoint", str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
         f"{name} @ {here}"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.whl")] == ["recoverypoint"]
