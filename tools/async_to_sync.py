"""Write the sync request path and its tests from their async source, as psycopg does.

The async modules are the source; each sync module is generated from one of them, so that
the two paths keep the same semantics and never drift, and the sync one runs as fast as
hand-written sync code: no event loop, no wrapper, the same statements.

The engine's tests are written once the same way: tests/test_engine_async.py checks
rp.AsyncEngine, and tests/test_engine_sync.py, generated from it, checks rp.Engine. Their
concurrency comes from tests/acompat.py, whose asyncio names (``aspawn``, ``agather``…) are
renamed to their thread twins (``spawn``, ``gather``…); the tests a sync module cannot
have (cancellation, the refusal of the other kind of phase) sit in ``if True:  # ASYNC``
blocks, with the anyio marks.

    python tools/async_to_sync.py          # write every sync module
    python tools/async_to_sync.py --check  # write nothing; exit 1 naming the stale ones

The translation works on the text, line by line, so comments and docstrings carry over:

1. ``if True:  # ASYNC`` blocks: the few lines that must differ. The block's body goes, its
   ``else:`` branch (if any) stays, one level less indented.
2. ``await`` and the ``async`` of ``async def``/``async with``/``async for`` go.
3. Names in :data:`NAMES` are renamed: the async classes, modules and types to their sync
   twins (dotted names first, then whole words).
4. Imports that became duplicates go; ruff then drops the unused ones, sorts them, joins
   the ``with`` statements that may now be one, and formats the module.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "src/recoverypoint/"

# Async source → generated sync module, relative to the repository.
PAIRS = {
    f"{PACKAGE}engine/_pg_async.py": f"{PACKAGE}engine/_pg.py",
    f"{PACKAGE}engine/store_async.py": f"{PACKAGE}engine/store.py",
    f"{PACKAGE}engine/context/atomic_async.py": f"{PACKAGE}engine/context/atomic.py",
    f"{PACKAGE}engine/run_async.py": f"{PACKAGE}engine/run.py",
    f"{PACKAGE}engine/listen_async.py": f"{PACKAGE}engine/listen.py",
    "tests/test_engine_async.py": "tests/test_engine_sync.py",
}

# Async name → sync name, in this order (dotted names before the words they contain).
NAMES = [
    ("import sqlalchemy.ext.asyncio as sa_async", "import sqlalchemy as sa"),
    ("from sqlalchemy.ext.asyncio import AsyncSession", "from sqlalchemy.orm import Session"),
    ("sa_async.AsyncEngine", "sa.Engine"),
    ("sa_async.AsyncConnection", "sa.Connection"),
    ("sa_async.create_async_engine", "sa.create_engine"),
    ("create_async_engine", "create_engine"),
    ("import asyncio", "import time"),
    ("asyncio.sleep", "time.sleep"),
    ("asynccontextmanager", "contextmanager"),
    ("AsyncIterator", "Iterator"),
    ("AsyncEngine", "Engine"),
    ("AsyncTransaction", "Transaction"),
    ("AsyncAtomicContext", "AtomicContext"),
    ("AsyncConnection", "Connection"),
    ("AsyncSession", "Session"),
    ("AsyncCursor", "Cursor"),
    ("AsyncRowFactory", "RowFactory"),
    ("_AsyncRun", "_Run"),
    ("async_db", "db"),
    ("_pg_async", "_pg"),
    ("_libpq_async", "_libpq"),
    ("store_async", "store"),
    ("atomic_async", "atomic"),
    ("listen_async", "listen"),
    ("AsyncKeyListener", "KeyListener"),
    ("AsyncHeartbeat", "Heartbeat"),
    # The tests' concurrency (tests/acompat.py): tasks become threads.
    ("AEvent", "Event"),
    ("aspawn", "spawn"),
    ("await_set", "wait_set"),
    ("ajoin", "join"),
    ("agather", "gather"),
]

_ASYNC_BLOCK = re.compile(r"^(\s*)if True:  # ASYNC(?:  # noqa: [A-Z0-9, ]+)?$")
_KEYWORDS = [
    (re.compile(r"\bawait "), ""),
    (re.compile(r"\basync (?=def |with |for )"), ""),
    (re.compile(r"\bAwaitable\[(\w+)\]"), r"\1"),  # Callable[..., Awaitable[T]] → T
]
_RENAMES = [(re.compile(rf"(?<!\w){re.escape(old)}\b"), new) for old, new in NAMES]


def header(source: str) -> str:
    """The first lines of the module generated from ``source`` (relative to the repository)."""
    return (
        f"# Generated from {source} by tools/async_to_sync.py:\n"
        f"# edit {source.removeprefix(PACKAGE)}, then run tools/async_to_sync.py.\n"
    )


def drop_async_blocks(lines: list[str]) -> list[str]:
    """Keep the ``else:`` branch of each ``if True:  # ASYNC`` block, dedented."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _ASYNC_BLOCK.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        i = _skip_body(lines, i + 1, indent)
        if i < len(lines) and lines[i] == f"{indent}else:":
            end = _skip_body(lines, i + 1, indent)
            out.extend(line.replace("    ", "", 1) for line in lines[i + 1 : end])
            i = end
    return out


def _skip_body(lines: list[str], i: int, indent: str) -> int:
    """The index of the first line after the block body that starts at ``i``."""
    deeper = indent + "    "
    while i < len(lines) and (lines[i].startswith(deeper) or not lines[i].strip()):
        i += 1
    return i


def translate(text: str) -> str:
    """The sync module's text, before ruff."""
    lines = drop_async_blocks(text.splitlines())
    body = "\n".join(lines) + "\n"
    for pattern, replacement in _KEYWORDS + _RENAMES:
        body = pattern.sub(replacement, body)
    seen: set[str] = set()
    kept = []
    for line in body.splitlines():
        if line.startswith(("import ", "from ")):
            if line in seen:
                continue
            seen.add(line)
        kept.append(line)
    return "\n".join(kept) + "\n"


def ruff(text: str, name: str) -> str:
    """``text`` with its unused imports dropped, sorted and formatted, as ruff does it;
    ``name`` is the module's path in the repository, whose ruff settings apply."""
    steps = [
        [
            "check",
            "--select",
            "I,F401,SIM117",
            "--fix",
            "--exit-zero",
            "--stdin-filename",
            name,
            "-",
        ],
        ["format", "--stdin-filename", name, "-"],
    ]
    for step in steps:
        text = subprocess.run(
            [sys.executable, "-m", "ruff", *step, "--quiet"],
            input=text,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
    return text


def generate(source: str) -> str:
    """The sync module generated from ``source`` (relative to the repository)."""
    text = translate((ROOT / source).read_text())
    return header(source) + ruff(text, PAIRS[source])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail if stale")
    args = parser.parse_args(argv)
    stale = []
    for source, target in PAIRS.items():
        wanted = generate(source)
        path = ROOT / target
        if path.exists() and path.read_text() == wanted:
            continue
        stale.append(target)
        if not args.check:
            path.write_text(wanted)
    if args.check and stale:
        print(
            f"stale: {', '.join(stale)}; run tools/async_to_sync.py and commit the result",
            file=sys.stderr,
        )
        return 1
    for target in [] if args.check else stale:
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
