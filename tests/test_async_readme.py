"""README, "Async": its example runs word for word against a migrated database."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_async_example_runs_as_written(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    section = README.read_text().split("## Async\n", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert example is not None
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)
    exec(compile(example.group(1), "README.md", "exec"), {"__name__": "readme_async"})
