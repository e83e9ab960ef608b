"""Figures of every run, their median and range across runs, the targets, as Markdown,
JSON and a PNG."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import facts as machine

TARGET_KEYS = 10_000_000


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    def show(self, fmt: str, runs: int, suffix: str = "") -> str:
        if runs == 1:
            return f"{self.median:{fmt}}{suffix}"
        return f"{self.median:{fmt}}{suffix} ({self.low:{fmt}} to {self.high:{fmt}})"


def spread(values: list[float | None]) -> Spread | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return Spread(statistics.median(known), min(known), max(known))


def ratios(run: dict[str, Any], concurrency: list[int], systems: list[str]) -> dict[str, float]:
    """Ratios within one run (whose systems ran interleaved), so drift cancels out."""
    flow = run["flow"]
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str, figure: str, clients: int) -> None:
        fa, fb = flow.get(f"{a}@{clients}"), flow.get(f"{b}@{clients}")
        if fa and fb and fa.get(figure) and fb.get(figure):
            out[f"{name}@{clients}"] = fa[figure] / fb[figure]

    for c in concurrency:
        ratio(
            "rate recoverypoint/reference", "recoverypoint", "reference", "requests_per_second", c
        )
        ratio("rate recoverypoint/dbos", "recoverypoint", "dbos", "requests_per_second", c)
        ratio(
            "rate recoverypoint/work-only", "recoverypoint", "work-only", "requests_per_second", c
        )
        ratio("rate work-only/reference", "work-only", "reference", "requests_per_second", c)
        ratio(
            "rate recoverypoint/recoverypoint-sqlalchemy",
            "recoverypoint",
            "recoverypoint-sqlalchemy",
            "requests_per_second",
            c,
        )
        ratio(
            "rate recoverypoint-observed/recoverypoint",
            "recoverypoint-observed",
            "recoverypoint",
            "requests_per_second",
            c,
        )
        ratio(
            "client cpu recoverypoint/reference", "recoverypoint", "reference", "client_cpu_ms", c
        )
        ratio(
            "server cpu recoverypoint/reference", "recoverypoint", "reference", "server_cpu_ms", c
        )
    replay = run.get("replay", {})
    ours, floor = replay.get("recoverypoint"), replay.get("prepared-select")
    if ours and floor:
        for p in ("p50_ms", "p99_ms"):
            out[f"replay {p} recoverypoint/prepared-select"] = ours[p] / floor[p]
    claims = run.get("claims", {})
    for server in CLAIM_SERVERS:
        empty, stored = claims.get(f"{server}empty"), claims.get(f"{server}stored")
        if empty and stored:
            for p in ("p50_ms", "p99_ms"):
                out[f"{server}claim growth {p}"] = stored[p] / empty[p] - 1
    return out


# The claim's servers, as prefixes of its key tables' names: the server the benchmark runs
# against, and the private one configured as the README says (claims.sized_server).
CLAIM_SERVERS = ("", "sized ")


def aggregate(runs: list[dict[str, Any]]) -> Any:
    """The same nesting as one run's figures, each number replaced by its spread."""

    def walk(items: list[Any]) -> Any:
        first = items[0]
        if isinstance(first, dict):
            keys = [k for k in first if all(isinstance(i, dict) and k in i for i in items)]
            return {k: walk([i[k] for i in items]) for k in keys}
        if isinstance(first, (int, float)) or first is None:
            return spread(items)
        return first

    return walk(runs)


@dataclass(frozen=True)
class Target:
    label: str
    figure: Spread | None
    threshold: float
    at_most: bool
    show: Callable[[Spread, int], str]
    note: str = ""


class Report:
    def __init__(
        self,
        runs: list[dict[str, Any]],
        settings: dict[str, Any],
        facts: dict[str, Any],
        systems: list[str],
        concurrency: list[int],
    ) -> None:
        self.runs = runs
        self.settings = settings
        self.facts = facts
        self.systems = systems
        self.concurrency = concurrency
        for run in runs:
            run["ratios"] = ratios(run, concurrency, systems)
        self.summary: Any = aggregate(runs)
        self.n = len(runs)

    # -- targets -------------------------------------------------------------------------

    def targets(self) -> list[Target]:
        ratios = self.summary["ratios"]
        replay = self.summary.get("replay", {}).get("recoverypoint", {})
        keys = self.settings["big_keys"]
        n = self.n

        def times(s: Spread, runs: int) -> str:
            return s.show(".2f", runs, "x")

        def ms(s: Spread, runs: int) -> str:
            return s.show(".3f", runs, " ms")

        def pct(s: Spread, runs: int) -> str:
            return Spread(s.median * 100, s.low * 100, s.high * 100).show("+.1f", runs, "%")

        targets = []
        for c in self.concurrency:
            targets.append(
                Target(
                    f"fresh-key req/s, recoverypoint ≥ 1.5x the reference, {clients(c)}",
                    ratios.get(f"rate recoverypoint/reference@{c}"),
                    1.5,
                    False,
                    times,
                )
            )
        for c in self.concurrency:
            targets.append(
                Target(
                    f"fresh-key req/s, recoverypoint ≥ 5x DBOS, {clients(c)}",
                    ratios.get(f"rate recoverypoint/dbos@{c}"),
                    5.0,
                    False,
                    times,
                )
            )
        for c in self.concurrency:
            targets.append(
                Target(
                    f"client CPU per request, recoverypoint ≤ 1.0x the reference, {clients(c)}",
                    ratios.get(f"client cpu recoverypoint/reference@{c}"),
                    1.0,
                    True,
                    times,
                )
            )
        for c in self.concurrency:
            targets.append(
                Target(
                    f"server CPU per request, recoverypoint ≤ 1.0x the reference, {clients(c)}",
                    ratios.get(f"server cpu recoverypoint/reference@{c}"),
                    1.0,
                    True,
                    times,
                )
            )
        targets.append(
            Target(
                "replay p99 ≤ 1.25x a prepared SELECT of the stored answer (1 client)",
                ratios.get("replay p99_ms recoverypoint/prepared-select"),
                1.25,
                True,
                times,
            )
        )
        redis = self.summary.get("replay", {})
        beside = []
        for name, label in (("redis-get", "Redis GET"), ("powertools-style", "Powertools-style")):
            if name in redis:
                beside.append((label, redis[name]))
        for p, limit in (("p50_ms", 0.2), ("p99_ms", 0.5)):
            others = "; ".join(f"{label} {fig[p].show('.3f', n, ' ms')}" for label, fig in beside)
            targets.append(
                Target(
                    f"replay {p[:3]} ≤ {limit} ms (1 client)",
                    replay.get(p),
                    limit,
                    True,
                    ms,
                    f"beside: {others}" if others else "Redis not measured",
                )
            )
        if keys:
            short = "" if keys >= TARGET_KEYS else f"; measured at {keys:,} keys, not 10,000,000"
            sized = self.settings.get("sized_server") or {}
            # Judged where the README's settings hold (shared_buffers holding the indexes);
            # this server's figure goes beside it.
            server = "sized " if sized and "sized claim growth p50_ms" in ratios else ""
            buffers = self.facts.get("postgresql", {}).get("settings", {}).get("shared_buffers")
            where = (
                f", on a server set as the README says ({sized['shared_buffers']} "
                f"shared_buffers, wal_compression {sized['wal_compression']})"
                if server
                else ""
            )
            for p in ("p50_ms", "p99_ms"):
                note = self._claim_note(server, p)
                if server and ratios.get(f"claim growth {p}") is not None:
                    note += f"; on this machine's server ({buffers} shared_buffers): " + pct(
                        ratios[f"claim growth {p}"], n
                    )
                targets.append(
                    Target(
                        f"claim {p[:3]} with 10,000,000 keys stored ≤ +10% of an empty "
                        f"table{where}",
                        ratios.get(f"{server}claim growth {p}"),
                        0.10,
                        True,
                        pct,
                        note + short,
                    )
                )
        return targets

    def _claim_note(self, server: str, p: str) -> str:
        claims = self.summary.get("claims", {})
        empty, stored = claims.get(f"{server}empty"), claims.get(f"{server}stored")
        if not empty or not stored:
            return ""
        return f"{stored[p].show('.3f', self.n)} vs {empty[p].show('.3f', self.n)} ms"

    def target_rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for t in self.targets():
            figure = t.figure
            if figure is None:
                rows.append({"target": t.label, "result": "not measured", "met": None})
                continue
            met = figure.median <= t.threshold if t.at_most else figure.median >= t.threshold
            result = t.show(figure, self.n) + (f" — {t.note}" if t.note else "")
            rows.append({"target": t.label, "result": result, "met": met})
        return rows

    # -- output --------------------------------------------------------------------------

    def _cell(self, s: Spread | None, fmt: str) -> str:
        return "n/a" if s is None else s.show(fmt, self.n)

    def markdown(self) -> str:
        st = self.settings
        n = self.n
        how = f"the median (min to max) of {n} runs" if n > 1 else "from one run"
        lines = [
            "# Benchmark results",
            "",
            f"Written by `benchmarks/run.py` ({st['command']}), in {st['wall_minutes']:.1f} min. "
            f"Figures are {how}; each run has {st['rounds']} rounds of "
            f"{st['seconds']:g} s per system and concurrency, systems interleaved and rotated; "
            f"fresh key per request. Connections are opened and {st['warmup']} warm-up "
            "requests per client sent before each timed window; DBOS is launched only for "
            f"its own windows. Phase API of the `recoverypoint` system: {st['phase_api']}. "
            + client_placement(st),
            "",
            *machine.markdown(self.facts),
            "",
            "## Targets",
            "",
            "| target | result | met? |",
            "|---|---|---|",
        ]
        for row in self.target_rows():
            met = {True: "yes", False: "**no**", None: "?"}[row["met"]]
            lines.append(f"| {row['target']} | {row['result']} | {met} |")
        lines += [
            "",
            "## Fresh key per request",
            "",
            "CPU columns: milliseconds of CPU per request; client = this process "
            "(`time.process_time()`), server = the PostgreSQL processes serving the "
            "benchmark's databases (`/proc/<pid>/stat`).",
            "",
            "| clients | system | requests/s | p50 ms | p99 ms | client CPU ms/req "
            "| server CPU ms/req | errors |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        flow = self.summary["flow"]
        for c in self.concurrency:
            for system in self.systems:
                f = flow.get(f"{system}@{c}")
                if f is None:
                    continue
                lines.append(
                    f"| {c} | {system} | {self._cell(f['requests_per_second'], ',.0f')} "
                    f"| {self._cell(f['p50_ms'], '.2f')} | {self._cell(f['p99_ms'], '.2f')} "
                    f"| {self._cell(f['client_cpu_ms'], '.3f')} "
                    f"| {self._cell(f['server_cpu_ms'], '.3f')} "
                    f"| {self._cell(f['errors'], ',.0f')} |"
                )
        ratios = self.summary["ratios"]
        lines += [
            "",
            "| clients | recoverypoint / reference | recoverypoint / DBOS "
            "| recoverypoint / recoverypoint-sqlalchemy | client CPU, recoverypoint / reference "
            "| recoverypoint / the work alone | the work alone / reference |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in self.concurrency:
            cells = [
                self._cell(ratios.get(f"{name}@{c}"), ".2f")
                for name in (
                    "rate recoverypoint/reference",
                    "rate recoverypoint/dbos",
                    "rate recoverypoint/recoverypoint-sqlalchemy",
                    "client cpu recoverypoint/reference",
                    "rate recoverypoint/work-only",
                    "rate work-only/reference",
                )
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        replay = self.summary.get("replay", {})
        if replay:
            lines += [
                "",
                f"## Replay of a finished key (1 client, {st['replays']:,} per system per run)",
                "",
                "| system | p50 ms | p99 ms | client CPU ms/req | server CPU ms/req |",
                "|---|---:|---:|---:|---:|",
            ]
            for name, f in replay.items():
                lines.append(
                    f"| {REPLAY_LABELS.get(name, name)} | {self._cell(f['p50_ms'], '.3f')} "
                    f"| {self._cell(f['p99_ms'], '.3f')} | {self._cell(f['client_cpu_ms'], '.3f')} "
                    f"| {self._cell(f['server_cpu_ms'], '.3f')} |"
                )
        claims = self.summary.get("claims", {})
        if claims:
            lines += [
                "",
                f"## Claim alone (1 client, {st['claims']:,} per table per run)",
                "",
                "| key table | p50 ms | p99 ms | server CPU ms/claim |",
                "|---|---:|---:|---:|",
            ]
            for server, where in zip(CLAIM_SERVERS, ("this server", "sized server"), strict=True):
                for name, label in (
                    ("empty", "empty"),
                    ("stored", f"{st['big_keys']:,} finished keys stored"),
                ):
                    f = claims.get(server + name)
                    if f:
                        lines.append(
                            f"| {where}: {label} | {self._cell(f['p50_ms'], '.3f')} "
                            f"| {self._cell(f['p99_ms'], '.3f')} "
                            f"| {self._cell(f['server_cpu_ms'], '.3f')} |"
                        )
        lines += ["", *self.noise()]
        return "\n".join(lines) + "\n"

    def noise(self) -> list[str]:
        """How busy the machine was with other work, and any unfair window."""
        busy: list[float] = []
        opened = 0.0
        for run in self.runs:
            for f in run["flow"].values():
                busy.append(f["other_cores_busy"])
                opened += f["connections_opened_in_window"]
        lines = []
        if busy:
            lines.append(
                f"Other work on the machine during the timed windows (cores busy with neither "
                f"this process nor the measured servers): median {statistics.median(busy):.2f}, "
                f"max {max(busy):.2f} of {self.facts['cpu_count']}."
            )
        lines.append(
            "Connections opened inside timed windows: "
            + ("none." if not opened else f"**{opened:.0f}** (see results.json).")
        )
        errors = {
            k: f["first_error"]
            for run in self.runs
            for k, f in run.get("errors", {}).items()
            if f.get("first_error")
        }
        for key, error in errors.items():
            lines.append(f"First error of {key}: `{' '.join(error.split())[:300]}`")
        for kind, count in self.settings.get("warnings_logged", {}).items():
            lines.append(f"Logged {count:,} times: `{kind}`")
        return [line + "  " if i < len(lines) - 1 else line for i, line in enumerate(lines)]

    def json(self) -> dict[str, Any]:
        def plain(obj: Any) -> Any:
            if isinstance(obj, Spread):
                return {"median": obj.median, "min": obj.low, "max": obj.high}
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            return obj

        return {
            "settings": self.settings,
            "machine": self.facts,
            "targets": self.target_rows(),
            "summary": plain(self.summary),
            "runs": self.runs,
        }

    def plot(self, path: Path) -> bool:
        try:
            import matplotlib
        except ImportError:
            return False
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        flow = self.summary["flow"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        panels = (
            ("requests_per_second", "Throughput (fresh key per request)", "requests/s"),
            ("p99_ms", "p99 latency", "ms"),
            ("client_cpu_ms", "CPU per request (solid: client, dashed: server)", "ms"),
        )
        for ax, (figure, title, unit) in zip(axes, panels, strict=True):
            for i, system in enumerate(self.systems):
                xs = [c for c in self.concurrency if f"{system}@{c}" in flow]
                color = f"C{i}"
                for fig_name, style in (
                    ((figure, "-"),)
                    if figure != "client_cpu_ms"
                    else (("client_cpu_ms", "-"), ("server_cpu_ms", "--"))
                ):
                    spreads = [flow[f"{system}@{c}"][fig_name] for c in xs]
                    if any(s is None for s in spreads):
                        continue
                    med = [s.median for s in spreads]
                    err = [
                        [s.median - s.low for s in spreads],
                        [s.high - s.median for s in spreads],
                    ]
                    ax.errorbar(
                        xs,
                        med,
                        yerr=err,
                        marker="o",
                        linestyle=style,
                        color=color,
                        capsize=3,
                        label=system if style == "-" else None,
                    )
            ax.set(title=title, xlabel="concurrent clients", ylabel=unit, xscale="log")
            if figure == "client_cpu_ms":
                ax.set_yscale("log")  # DBOS's CPU per request is an order of magnitude more
            ax.set_xticks(self.concurrency, [str(c) for c in self.concurrency])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(
            f"median and range of {self.n} run(s); {self.facts['cpu_count']} CPUs, "
            f"{self.facts['postgresql']['version'].split(' on ')[0]}",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True


def clients(c: int) -> str:
    return f"{c} client" if c == 1 else f"{c} clients"


REPLAY_LABELS = {
    "recoverypoint": "recoverypoint (`Engine.run` on a finished key)",
    "reference": "hand-written reference (claim transaction on a finished key)",
    "prepared-select": "prepared SELECT of the stored answer (psycopg, autocommit)",
    "redis-get": "Redis GET of the stored response",
    "powertools-style": "Powertools-style Redis lookup (SET NX, GET, checks)",
}


def client_placement(settings: dict[str, Any]) -> str:
    """Where the client threads ran (``--pin-client``)."""
    cpus = settings.get("client_cpus", "any")
    if cpus == "any":
        return "Client threads: wherever the kernel put them."
    return f"Client threads: pinned to CPU {', '.join(map(str, cpus))} (`--pin-client`)."
