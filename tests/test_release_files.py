"""What a package index and a team reviewing a dependency look for: the licence
pyproject.toml names, a changelog with an Unreleased section, a security policy, and
``recoverypoint --version`` answering the installed version (defined in pyproject.toml
alone); and the release files as docs/install.md shows them: built by its commands from
this checkout, named as it names them, passed by ``twine check --strict``, and holding the
files it says they hold."""

from __future__ import annotations

import importlib.metadata
import shlex
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
from docs_snippets import section

pytestmark = pytest.mark.slow  # the package built and read

ROOT = Path(__file__).resolve().parents[1]
TOP_FILES = {"README.md", "LICENSE", "CHANGELOG.md", "SECURITY.md"}


def test_the_licence_is_the_one_pyproject_names() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_the_changelog_has_an_unreleased_section_and_the_current_version() -> None:
    lines = (ROOT / "CHANGELOG.md").read_text().splitlines()
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Unreleased"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert any(h.startswith(f"## {version} - ") for h in headings), headings


def test_the_security_policy_says_how_to_report() -> None:
    text = (ROOT / "SECURITY.md").read_text()
    assert "## Reporting a vulnerability" in text and "console" in text


def test_version_answers_the_installed_version() -> None:
    answer = subprocess.run(
        [sys.executable, "-m", "recoverypoint", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert answer.stdout.strip() == f"recoverypoint {importlib.metadata.version('recoverypoint')}"


def test_the_release_is_the_files_the_install_page_shows(tmp_path: Path) -> None:
    commands, listing = [b.body for b in section("install.md", "The release files")]
    build, check = [shlex.split(line) for line in commands.strip().split("\n")]
    assert build == ["python", "-m", "build", "--outdir", "dist", "."]
    assert check == ["twine", "check", "--strict", "dist/*"]
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, *build[1:4], str(dist), "."], cwd=ROOT, check=True, capture_output=True
    )
    built = sorted(dist.iterdir())
    assert [f"dist/{f.name}" for f in built] == listing.strip().split("\n")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", *check[1:3], *map(str, built)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    wheel, sdist = built
    with tarfile.open(sdist) as archive:
        top = {Path(name).name for name in archive.getnames() if name.count("/") == 1}
    assert top >= TOP_FILES
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    info = wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"
    assert f"{info}/licenses/LICENSE" in names
    assert "recoverypoint/_migrations/env.py" in names
    assert not {"CHANGELOG.md", "SECURITY.md"} & {Path(n).name for n in names}
