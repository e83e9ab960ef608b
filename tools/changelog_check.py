"""Each change to ``src/`` tells its users in CHANGELOG.md, or says it has nothing to tell.

CI runs ``python tools/changelog_check.py`` on its clone. Every commit since the rule began
(the commit that added this file) that changes a file under ``src/`` must also add or edit a
line of CHANGELOG.md's ``## Unreleased`` section, or end its message with the trailer
``Changelog: none``, for a change no user can see: a refactor, a comment, a name inside a
module. The trailer is the lighter rule, and deliberate: it costs one line where an entry
would say nothing, yet a commit can no longer forget the changelog silently; whoever writes
it has decided, in the history, that users see no difference. A commit that landed without
either is made good by a later one that names it in a trailer ``Changelog-for: <hash>`` and
itself edits the Unreleased section or carries ``Changelog: none`` (history is not
rewritten). Only commits that descend from the rule's are judged: a branch forked before
it and merged after it is not held to it.

Exit status 0 when every commit keeps the rule; 1 with each commit that does not, and what
to do; 2 when the history is not there to read (a shallow clone).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CHANGELOG = "CHANGELOG.md"
SOURCE = "src/"
RULE = "tools/changelog_check.py"
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.MULTILINE)


def _git(repo: Path, *args: str) -> str:
    # Plumbing, and no colour or external diff whatever the user's configuration says.
    command = ["git", "-C", str(repo), "-c", "color.ui=never", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _trailers(repo: Path, commit: str, key: str) -> list[str]:
    """The values of ``commit``'s trailers named ``key`` (the message's last paragraph)."""
    found = _git(repo, "log", "-1", f"--format=%(trailers:key={key},valueonly)", commit)
    return [value.strip().lower() for value in found.splitlines() if value.strip()]


def unreleased_lines(text: str) -> range:
    """The line numbers (1-based) of the ``## Unreleased`` section, its heading's included."""
    lines = text.splitlines()
    start = lines.index("## Unreleased") + 1 if "## Unreleased" in lines else 0
    if not start:
        return range(0)
    after = (i for i, line in enumerate(lines[start:], start + 1) if line.startswith("## "))
    return range(start, next(after, len(lines) + 1))


def touches_unreleased(repo: Path, commit: str) -> bool:
    """Whether ``commit`` adds or edits a line of CHANGELOG.md's Unreleased section."""
    diff = _git(repo, "diff-tree", "-p", "-U0", "--no-ext-diff", "--root", commit, "--", CHANGELOG)
    if not diff:
        return False
    try:
        section = unreleased_lines(_git(repo, "show", f"{commit}:{CHANGELOG}"))
    except subprocess.CalledProcessError:  # the commit deleted it
        return False
    for found in _HUNK.finditer(diff):
        first, count = int(found.group(1)), int(found.group(2) or 1)
        if count and any(line in section for line in range(first, first + count)):
            return True
    return False


def offenders(repo: Path) -> list[str]:
    """``hash subject`` of each commit since the rule began that breaks it."""
    added = _git(repo, "log", "--diff-filter=A", "--format=%H", "--", RULE).split()
    if not added:
        return []  # the rule is not committed yet
    since = added[-1]
    commits = _git(
        repo, "rev-list", "--no-merges", "--reverse", "--ancestry-path", f"{since}..HEAD"
    )
    broken: dict[str, str] = {}
    for commit in commits.split():
        told = touches_unreleased(repo, commit) or "none" in _trailers(repo, commit, "Changelog")
        if told:  # it may make good earlier commits that told nothing
            for named in _trailers(repo, commit, "Changelog-for"):
                for earlier in [c for c in broken if c.startswith(named)]:
                    del broken[earlier]
            continue
        files = _git(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root", commit)
        if any(name.startswith(SOURCE) for name in files.split()):
            broken[commit] = _git(repo, "log", "-1", "--format=%h %s", commit).strip()[:100]
    return list(broken.values())


def main(argv: list[str]) -> int:
    repo = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    if _git(repo, "rev-parse", "--is-shallow-repository").strip() == "true":
        print(
            "changelog check: this clone has part of the history only; "
            "fetch the rest (git fetch --unshallow) and run it again",
            file=sys.stderr,
        )
        return 2
    broken = offenders(repo)
    for line in broken:
        print(f"changelog check: {line}", file=sys.stderr)
    if broken:
        print(
            f"these commits change {SOURCE} without a line under '## Unreleased' in "
            f"{CHANGELOG}: amend each (before it lands) to add a line saying what a user sees, "
            "or to end its message with 'Changelog: none' where users see nothing; once "
            "landed, a commit that does either and carries the trailer 'Changelog-for: <hash>'",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
