"""How the operator commands print: JSON for scripts (``--json``), tables for people.

Tables use ``rich`` when it is installed (``pip install 'recoverypoint[cli]'``) and stdout
is a terminal; otherwise plain aligned columns, which ``grep``, ``awk`` and ``head`` read
line by line. Nothing here decides anything: it only formats.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import date, datetime
from typing import Any
from uuid import UUID


def print_json(value: Any) -> None:
    print(json.dumps(value, default=_jsonable, indent=2, ensure_ascii=False))


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    if sys.stdout.isatty() and _rich_table(headers, cells):
        return
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    for line in [list(headers), *cells]:
        print(
            "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        )


def _rich_table(headers: Sequence[str], cells: list[list[str]]) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(*headers, box=None, header_style="bold", pad_edge=False)
    for row in cells:
        table.add_row(*row)
    Console(highlight=False).print(table)
    return True


def print_fields(fields: Sequence[tuple[str, object]]) -> None:
    """``name  value`` lines, names aligned."""
    width = max((len(name) for name, _ in fields), default=0)
    for name, value in fields:
        print(f"{name.ljust(width)}  {_cell(value)}")


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    return " ".join(str(value).split())  # one line per row, whatever the value holds


def seconds(value: float | None) -> str:
    """``42s``, ``7m``, ``2h05m``, ``3d04h``."""
    if value is None:
        return "-"
    total = int(abs(value))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s" if total < 600 else f"{total // 60}m"
    if total < 86400:
        return f"{total // 3600}h{total % 3600 // 60:02d}m"
    return f"{total // 86400}d{total % 86400 // 3600:02d}h"


def due(value: float | None) -> str:
    """A time relative to now: ``in 2m``, ``overdue 7m``."""
    if value is None:
        return "-"
    return f"in {seconds(value)}" if value > 0 else f"overdue {seconds(value)}"


def truncate(text: str | None, width: int = 40) -> str | None:
    if text is None:
        return None
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
