"""tools/changelog_check.py, which CI runs on its clone: a commit that changes src/ edits
CHANGELOG.md's Unreleased section or says ``Changelog: none``; tried on histories of a
repository made for each test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from docs_snippets import section

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = """# Changelog

## Unreleased

### Added

- Something.

## 0.1.0 - 2026-11-28

- The first release.
"""


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "changelog_check", ROOT / "tools" / "changelog_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _tool()


class Repo:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.git("init", "-q", "-b", "main")
        self.write("CHANGELOG.md", CHANGELOG)
        self.write("src/pkg.py", "A = 1\n")
        self.commit("before the rule: src/ without the changelog is not judged")
        self.write("tools/changelog_check.py", "# the rule\n")
        self.commit("the rule")

    def git(self, *args: str) -> str:
        # Whatever the machine's git configuration (signing, colour), none of it applies.
        env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
        return subprocess.run(
            ["git", "-c", "user.name=T", "-c", "user.email=t@example.com", *args],
            cwd=self.path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def write(self, name: str, text: str) -> None:
        (self.path / name).parent.mkdir(parents=True, exist_ok=True)
        (self.path / name).write_text(text)

    def edit_changelog(self, old: str, new: str) -> None:
        text = (self.path / "CHANGELOG.md").read_text()
        self.write("CHANGELOG.md", text.replace(old, new, 1))

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "--short", "HEAD").strip()

    def offenders(self) -> list[str]:
        found: list[str] = check.offenders(self.path)
        return [line.split(" ", 1)[1] for line in found]


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    (tmp_path / "repo").mkdir()
    return Repo(tmp_path / "repo")


def test_a_change_to_src_with_an_unreleased_line_keeps_the_rule(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    repo.edit_changelog("- Something.", "- Something.\n- A is 2.")
    repo.commit("A is 2")
    repo.write("tests/test_pkg.py", "")
    repo.commit("a test alone needs no line")
    assert repo.offenders() == []
    assert check.main([str(repo.path)]) == 0


def test_a_change_to_src_without_one_breaks_it(
    repo: Repo, capsys: pytest.CaptureFixture[str]
) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    repo.commit("A is 2, untold")
    assert repo.offenders() == ["A is 2, untold"]
    assert check.main([str(repo.path)]) == 1
    assert "Changelog: none" in capsys.readouterr().err


def test_a_line_under_a_release_is_not_an_unreleased_one(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    repo.edit_changelog("- The first release.", "- The first release.\n- A is 2.")
    repo.commit("A is 2, told under 0.1.0")
    assert repo.offenders() == ["A is 2, told under 0.1.0"]


def test_the_trailer_says_users_see_nothing(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 1  # why A is 1\n")
    repo.commit("A comment\n\nChangelog: none")
    assert repo.offenders() == []


def test_the_words_count_only_as_the_trailer_at_the_end(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    repo.commit("A is 2\n\nChangelog: none\n\nthough users see it")
    assert repo.offenders() == ["A is 2"]


def test_a_commit_that_deletes_the_changelog_is_judged_not_a_crash(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    (repo.path / "CHANGELOG.md").unlink()
    repo.commit("A is 2, and no changelog")
    assert repo.offenders() == ["A is 2, and no changelog"]


def test_a_branch_forked_before_the_rule_is_not_held_to_it(repo: Repo) -> None:
    repo.git("checkout", "-q", "-b", "old", "HEAD~1")
    repo.write("src/other.py", "B = 1\n")
    repo.commit("B, before the rule")
    repo.git("checkout", "-q", "main")
    repo.git("merge", "-q", "--no-edit", "old")
    assert repo.offenders() == []


def test_a_later_commit_makes_good_one_that_landed_untold(repo: Repo) -> None:
    repo.write("src/pkg.py", "A = 2\n")
    untold = repo.commit("A is 2, untold")
    repo.write("src/pkg.py", "A = 3  # why\n")
    comment = repo.commit("A comment, without its trailer")
    repo.edit_changelog("- Something.", "- Something.\n- A is 2.")
    repo.commit(f"CHANGELOG: A is 2\n\nChangelog-for: {untold}")
    assert repo.offenders() == ["A comment, without its trailer"]
    repo.write("tests/test_pkg.py", "")
    repo.commit(f"A test\n\nChangelog: none\nChangelog-for: {comment}")
    assert repo.offenders() == []


def test_a_shallow_clone_is_refused(repo: Repo, tmp_path: Path) -> None:
    shallow = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", f"file://{repo.path}", str(shallow)], check=True
    )
    assert check.main([str(shallow)]) == 2


def test_ci_runs_the_command_contributing_shows() -> None:
    (block,) = section("contributing.md", "The changelog")
    command = block.body.strip()
    assert command == "python3 tools/changelog_check.py"
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
