"""The sync request path and the sync engine's tests are generated from their async source
(tools/async_to_sync.py): each generated module must be what its source gives today, and must
stay plain sync code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import async_to_sync  # noqa: E402

GENERATED = sorted(async_to_sync.PAIRS.items())


@pytest.mark.slow
def test_the_generated_modules_are_current() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "async_to_sync.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


def test_the_engine_tests_are_generated_too() -> None:
    assert async_to_sync.PAIRS["tests/test_engine_async.py"] == "tests/test_engine_sync.py"
    wanted = async_to_sync.generate("tests/test_engine_async.py")
    assert (ROOT / "tests" / "test_engine_sync.py").read_text() == wanted


@pytest.mark.parametrize(("source", "target"), GENERATED)
def test_a_generated_module_is_plain_sync_code(source: str, target: str) -> None:
    text = (ROOT / target).read_text()
    assert text.startswith(async_to_sync.header(source))
    words = ("asyncio", "anyio", "await ", "async def", "async with", "greenlet", "# ASYNC")
    for word in words:
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


def test_a_test_module_loses_its_marks_and_runs_its_calls_in_threads() -> None:
    source = (
        "if True:  # ASYNC\n"
        "    pytestmark = pytest.mark.anyio\n"
        "\n"
        "\n"
        "async def test_f(engine: rp.AsyncEngine) -> None:\n"
        "    first = aspawn(engine.run, op)\n"
        "    await agather(*[attempt] * 2)\n"
        "    assert (await ajoin(first)).status == 201\n"
    )
    assert async_to_sync.translate(source) == (
        "def test_f(engine: rp.Engine) -> None:\n"
        "    first = spawn(engine.run, op)\n"
        "    gather(*[attempt] * 2)\n"
        "    assert (join(first)).status == 201\n"
    )
