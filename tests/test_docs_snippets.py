"""Every code block of README.md and docs/ is run by a test or says why not (see
``docs_snippets``), and the ``python`` blocks no other test claims run here.

A page's unmarked ``python`` blocks run in order, as a reader pastes them: a block whose
first line is ``# path/name.py`` is written to that file (the project directory is the
working directory and on ``sys.path``); every other block is executed, all of a page's in
one namespace. Each page gets a fresh database migrated as ``recoverypoint migrate`` does,
in ``$RECOVERYPOINT_DATABASE_URL``, so that keys and tables are its own.
"""

from __future__ import annotations

import asyncio
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from docs_snippets import ROOT, Block, blocks, pages
from hypothesis import given
from hypothesis import strategies as st

from recoverypoint import migrate
from recoverypoint.testing import temporary_database


def unmarked(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.mark == "" and b.lang == "python"]


RUN_HERE = [p for p in pages() if unmarked(p)]


def test_every_block_is_run_or_says_why_not() -> None:
    problems = []
    for page in pages():
        name = page.relative_to(ROOT / "docs") if page.parent != ROOT else Path(page.name)
        for block in blocks(page):
            if block.mark == "not-run":
                if len(block.mark_value) < 10:
                    problems.append(f"{block.where}: say why it is not run")
            elif block.mark == "test":
                test = ROOT / block.mark_value
                if not test.is_file() or not test.name.startswith("test_"):
                    problems.append(f"{block.where}: no test module {block.mark_value}")
                elif name.as_posix() not in test.read_text():
                    problems.append(f"{block.where}: {block.mark_value} does not read {name}")
            elif block.lang != "python":
                problems.append(
                    f"{block.where}: a {block.lang or 'plain'} block no test runs; mark it "
                    "<!-- test: tests/… --> or <!-- not-run: why -->"
                )
    assert not problems, "\n".join(problems)


# Starlette would rather have httpx2 under the TestClient a page uses; httpx is installed,
# and a reader sees only a warning.
@pytest.mark.filterwarnings("ignore::starlette.exceptions.StarletteDeprecationWarning")
@pytest.mark.parametrize("page", RUN_HERE, ids=[str(p.relative_to(ROOT)) for p in RUN_HERE])
@pytest.mark.slow
def test_the_python_blocks_of_the_page_run(
    page: Path, server_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = set(sys.modules)
    # The page's namespace is a module, as a reader's script is: libraries that look
    # names up in a class's module (SQLAlchemy's annotations) find them.
    module = types.ModuleType(f"docs_page_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    namespace: dict[str, Any] = vars(module)
    with temporary_database(server_url, prefix="rp_docs") as url:
        migrate.upgrade(url)
        monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", url)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        try:
            for block in unmarked(page):
                if block.file_name:
                    target = tmp_path / block.file_name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(block.body)
                else:
                    exec(compile(block.body, block.where, "exec"), namespace)
        finally:
            # The page's modules go with its database: nothing of one page reaches the next.
            mine = [
                name
                for name in set(sys.modules) - before
                if name == module.__name__
                or str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(tmp_path))
            ]
            scopes = [vars(sys.modules[name]) for name in mine]
            for name in mine:
                del sys.modules[name]
            for scope in scopes:
                for value in list(scope.values()):
                    dispose = getattr(value, "dispose", None)
                    if callable(dispose) and type(value).__module__.startswith(
                        ("recoverypoint", "sqlalchemy")
                    ):
                        result = dispose()
                        if asyncio.iscoroutine(result):  # an AsyncEngine's
                            asyncio.run(result)


def test_the_readmes_links_into_the_docs_exist() -> None:
    """README.md is outside the site that ``mkdocs build --strict`` checks: its links are
    checked here, each anchor against the headings of the page it names."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) > 10
    missing = [link for link, _ in links if not (ROOT / link).is_file()]
    assert not missing, missing
    unanchored = [
        f"{link}#{anchor}"
        for link, anchor in links
        if anchor and anchor not in _heading_anchors((ROOT / link).read_text())
    ]
    assert not unanchored, unanchored
    # Sections the front page links by name.
    anchored = {(link, anchor) for link, anchor in links if anchor}
    assert ("docs/how-to/testing.md", "prove-your-operation-crash-safe") in anchored
    assert (
        "docs/how-to/production.md",
        "running-in-production-replicas-failover-and-poolers",
    ) in anchored


def _heading_anchors(markdown: str) -> set[str]:
    """The anchors of a page's headings as the site makes them (Python-Markdown's toc:
    lower case, punctuation dropped, spaces and hyphens as one hyphen)."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", markdown, re.MULTILINE):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


# A line of a block: any text a UTF-8 file holds (no surrogates), but a fence.
_LINE = st.text(
    st.characters(
        exclude_categories=("Cs",),
        exclude_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
    ),
    max_size=40,
).filter(lambda line: not line.strip().startswith("```"))


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["python", "bash", "text", ""]),
            st.sampled_from(["", "test: tests/test_x.py", "not-run: a reason given"]),
            st.lists(_LINE, max_size=6),
            st.sampled_from(["", "  ", "    "]),
        ),
        max_size=5,
    )
)
def test_blocks_are_read_back_as_written(
    tmp_path_factory: pytest.TempPathFactory,
    written: list[tuple[str, str, list[str], str]],
) -> None:
    """Whatever a block holds (odd unicode, NUL, lines like HTML comments), it is read back
    whole, with its language and its mark, and nothing else is taken for a block."""
    text = ["# A page", ""]
    for lang, mark, lines, indent in written:
        text += ["Some prose.", ""]
        if mark:
            text.append(f"{indent}<!-- {mark} -->")
        text += [f"{indent}```{lang}", *(indent + line for line in lines), f"{indent}```", ""]
    page = tmp_path_factory.mktemp("page") / "page.md"
    page.write_text("\n".join(text))
    found = blocks(page)
    assert [(b.lang, b.mark, b.mark_value) for b in found] == [
        (lang, *(mark.split(": ", 1) if mark else ("", ""))) for lang, mark, _, _ in written
    ]
    assert [b.body for b in found] == [
        "".join(line + "\n" for line in lines) or "\n" for _, _, lines, _ in written
    ]
