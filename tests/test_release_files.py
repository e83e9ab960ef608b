"""What a package index and a team reviewing a dependency look for: the licence
pyproject.toml names, a changelog with an Unreleased section, a security policy, and
``recoverypoint --version`` answering the installed version (defined in pyproject.toml
alone)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
