"""The demo's report: one table for people, the same figures as JSON for machines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checks import Checked
from .load import LoadResult


@dataclass
class Report:
    settings: dict[str, Any]
    """What was run: requests, concurrency, seed, the fault mix, the database."""
    load: LoadResult
    checked: Checked
    process_exits: dict[str, dict[str, int]]
    """Per process group: exits by an injected fault, other exits, restarts."""
    settle_seconds: float

    @property
    def ok(self) -> bool:
        return self.checked.ok

    def figures(self) -> dict[str, int | float]:
        sent = self.load.sent
        return {
            "requests sent": len(sent),
            "retries": self.load.retries,
            "replays": sum(1 for s in sent if s.replayed),
            "409s": self.load.conflicts,
            **self.checked.figures,
            "API processes killed": self.process_exits["API"]["faults"],
            "enqueuers killed": self.process_exits["enqueuer"]["faults"],
            # A process that failed at start while the database was down, say; restarted.
            "other process exits": sum(exits["other"] for exits in self.process_exits.values()),
            "load seconds": round(self.load.seconds, 1),
            "completer seconds after the load": round(self.settle_seconds, 1),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "settings": self.settings,
            "figures": self.figures(),
            "invariants": {
                name: {"count": inv.count, "examples": inv.examples}
                for name, inv in self.checked.invariants.items()
            },
            "process_exits": self.process_exits,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")

    def table(self) -> str:
        rows = [(name, _number(value), "") for name, value in self.figures().items()]
        rows += [
            (name, str(inv.count), "ok" if inv.count == 0 else "FAILED")
            for name, inv in self.checked.invariants.items()
        ]
        width = max(len(name) for name, _, _ in rows)
        values = max(len(value) for _, value, _ in rows)
        lines = [
            f"{name:<{width}}  {value:>{values}}  {verdict}".rstrip()
            for name, value, verdict in rows
        ]
        rule = "-" * (width + values + 10)
        lines.insert(len(self.figures()), rule)
        for name, inv in self.checked.invariants.items():
            for example in inv.examples:
                lines.append(f"  {name}: {example}")
        verdict = "every invariant holds" if self.ok else "INVARIANTS FAILED"
        return "\n".join([rule, *lines, rule, verdict])


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"
