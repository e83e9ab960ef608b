"""The code blocks of README.md and docs/**/*.md, and who runs each of them.

Every fenced block is run by a test; the line just above its fence says which, or says
why it is not run:

- nothing: a ``python`` block, run by ``tests/test_docs_snippets.py`` with the other
  unmarked blocks of its page, in order, in one namespace (see there);
- ``<!-- test: tests/test_x.py -->``: that module runs it (it reads the page by name);
- ``<!-- not-run: why -->``: shell commands for another machine, output shown for reading,
  a configuration file of another program. The reason is required.

``tests/test_docs_snippets.py::test_every_block_is_run_or_says_why_not`` holds this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*$")
_MARK = re.compile(r"^\s*<!-- (?P<kind>test|not-run): (?P<value>.*?) -->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    heading: str  # the nearest heading above the block
    mark: str  # "", "test" or "not-run"
    mark_value: str  # the test module, or the reason

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def file_name(self) -> str | None:
        """``path/name.py`` when the block's first line is ``# path/name.py``: a file the
        reader writes, not code to paste into a session."""
        first = self.body.split("\n", 1)[0]
        found = re.fullmatch(r"# ([\w/.-]+\.py)", first.strip())
        return found.group(1) if found else None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, outermost only, with their bodies dedented."""
    found: list[Block] = []
    lines = page.read_text().split("\n")
    heading = ""
    n = 0
    while n < len(lines):
        line = lines[n]
        if line.startswith("#") and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        fence = _FENCE.match(line)
        if fence is None:
            n += 1
            continue
        indent = fence.group("indent")
        end = n + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(
            text[len(indent) :] if text.startswith(indent) else text for text in lines[n + 1 : end]
        )
        previous = lines[n - 1] if n else ""
        mark = _MARK.match(previous)
        found.append(
            Block(
                page=page,
                line=n + 1,
                lang=fence.group("lang"),
                body=body + "\n",
                heading=heading,
                mark=mark.group("kind") if mark else "",
                mark_value=mark.group("value").strip() if mark else "",
            )
        )
        n = end + 1
    return found


def page(name: str) -> Path:
    """``docs/<name>``, or README.md."""
    return ROOT / name if name == "README.md" else DOCS / name


def section(name: str, heading: str) -> list[Block]:
    """The blocks of page ``name`` under ``heading`` (the nearest heading above them)."""
    found = [b for b in blocks(page(name)) if b.heading == heading]
    assert found, f"no code block under {heading!r} in {name}"
    return found
