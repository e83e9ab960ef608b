"""The sync request path is generated from the async one (tools/async_to_sync.py): each
generated module must be what its source gives today, and must stay plain sync code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import async_to_sync  # noqa: E402

GENERATED = sorted(async_to_sync.PAIRS.items())


def test_the_generated_modules_are_current() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "async_to_sync.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize(("source", "target"), GENERATED)
def test_a_generated_module_is_plain_sync_code(source: str, target: str) -> None:
    text = (async_to_sync.PACKAGE / target).read_text()
    assert text.startswith(async_to_sync.header(source))
    for word in ("asyncio", "await ", "async def", "async with", "greenlet", "# ASYNC"):
        assert word not in text, f"{target} has {word!r}"


def test_an_async_block_keeps_its_else_branch_only() -> None:
    source = (
        "async def f():\n"
        "    if True:  # ASYNC\n"
        "        await g()\n"
        "    else:\n"
        "        h()\n"
        "    if True:  # ASYNC\n"
        "        only_async()\n"
        "    return await AsyncEngine()\n"
    )
    assert async_to_sync.translate(source) == "def f():\n    h()\n    return Engine()\n"
