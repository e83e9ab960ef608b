"""The key table's size against a request's cost: the claim of a fresh key and the replay
of a finished one, in a table of ``--keys`` finished keys (10,000,000 by default) against
the same in a table of 1,000.

    .venv/bin/python benchmarks/scale.py [--keys 10000000] [--ops 20000] [--runs 3]
        [--shared-buffers 6GB] [--huge-pages]

Both tables are databases of a private server of this machine's PostgreSQL, configured as
the README's table of database settings says (``claims.sized_server``: ``shared_buffers``
that hold the key table's indexes; ``--shared-buffers`` sets another size, a quarter of
the machine's memory, say), and filled once by ``claims.ensure_filled`` (kept between
runs). Each operation is the engine's own statement in the engine's own transaction: the
claim as ``claims.Claimer`` runs it, the replay as ``Engine.run`` reads a finished key
before anything else (``store.finished_key``). Beside that read, the replay as a caller
sees it: ``Engine.run`` itself of the same keys (the request built and checked, the key
judged, the stored answer rebuilt). A replay asks for a key drawn
at random from the last RECENT the fill stored (a minute of keys at 2,000 a second, the
keys a client's retry asks for; their rows are read into ``shared_buffers`` first, as a
server holds the rows it has just written), or from the whole table, whose rows do not
all fit in ``shared_buffers`` beside the indexes (a replay may then read its row's page
from the operating system's cache); where ``--shared-buffers`` holds the whole table, it
is read in first, as a server that wrote every row holds them then (``--huge-pages`` puts
them in huge pages). The tables are measured in turns, in blocks of 500, so that drift of
this shared machine falls on both; the claims' rows are deleted (and vacuumed away) before
the replays, which run on the tables as filled. Prints and writes
``results/scale.md`` and ``.json``; the change shown is that of the medians, with the
range of the runs' own changes. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import claims
import facts
import psycopg
import sqlalchemy as sa
from measure import every_postgres_cpu, percentile

import recoverypoint as rp
from recoverypoint.engine import sql, store

HERE = Path(__file__).resolve().parent
SMALL = 1_000
BLOCK = 500
Keys = Callable[[], str]  # draws the key of the next operation
# A minute of keys at 2,000 finished a second: the keys a client's retry asks for.
RECENT = 120_000


def fill_key(i: int, count: int) -> str:
    """The key string ``claims.FILL`` stores as its ``i``-th of ``count``."""
    return f"{i * 4294967296 // count:08x}-0000-4000-8000-{i:012x}"


class EngineReplayer(claims.Claimer):
    """A replay as a caller sees it: ``Engine.run`` of a finished key, the request it was
    stored for (the fill's ``POST /x`` with params ``{}``), kept for ten years so that a
    fill kept between runs is never past its retention."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.operation: rp.Operation[Any] = rp.Operation(
            claims.OPERATION, retention=timedelta(days=3650)
        )

        @self.operation.atomic_phase("finished")
        def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
            raise AssertionError("a replay runs no phase")

        self.engine.register(self.operation)
        self.request = rp.Request("POST", "/x")

    def run(self, key: str) -> Any:
        outcome = self.engine.run(
            self.operation, key=key, params={}, scope=claims.SCOPE, request=self.request
        )
        assert outcome.replayed, f"{key} is not a finished key of the table"
        return outcome


class Replayer(claims.Claimer):
    """The replay's read of a finished key (``store.finished_key``), as ``Engine.run``
    makes it before anything else, in the engine's transaction."""

    def run(self, key: str) -> Any:
        request = claims.claim_request(key)
        finished, _ = self.engine._transact(
            functools.partial(store.finished_key, bound=False), request, 10 * 365 * 86400.0
        )
        assert finished is not None, f"{key} is not a finished key of the table"
        return finished


def prewarm_recent(url: str) -> None:
    """Read the heap pages of the fill's last RECENT keys into ``shared_buffers``, as a
    server holds the rows it wrote in the last minute."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_prewarm('idempotency_keys', 'buffer', 'main', min(page), max(page)) "
            "FROM (SELECT (ctid::text::point)[0]::bigint AS page FROM idempotency_keys "
            f"      WHERE id > (SELECT last_id FROM {claims.MARKER}) - %(recent)s "
            f"        AND id <= (SELECT last_id FROM {claims.MARKER})) AS recent",
            {"recent": RECENT},
        )


def prewarm_if_it_fits(url: str) -> bool:
    """Read the whole key table into ``shared_buffers`` when it fits there beside its
    indexes, as a server that wrote every row holds them then; whether it did."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_total_relation_size('idempotency_keys') < "
            "pg_size_bytes(current_setting('shared_buffers')) * 0.9"
        ).fetchone()
        if row is None or not row[0]:
            return False
        conn.execute("SELECT pg_prewarm('idempotency_keys')")
        return True


def forget_claims(url: str) -> None:
    """The table as filled again: the claims' rows deleted, and vacuumed away."""
    claims.forget_claims(url, big=True)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM idempotency_keys")


def server_side(url: str, keys: list[str]) -> dict[str, float]:
    """The replay's statement under ``EXPLAIN (ANALYZE, BUFFERS)`` for each of ``keys``:
    its execution time on the server (p50, p99) and the pages it found in
    ``shared_buffers`` or read from the operating system, per replay."""
    took, hit, read = [], 0, 0
    explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FIND_FINISHED.text
    with psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        for key in keys:
            params = {"scope": claims.SCOPE, "operation": claims.OPERATION, "key": key}
            row = conn.execute(explain, {**params, "retention": 1e9}).fetchone()
            assert row is not None
            (plan,) = row[0]
            took.append(plan["Execution Time"])
            hit += plan["Plan"]["Shared Hit Blocks"]
            read += plan["Plan"]["Shared Read Blocks"]
    return {
        "execution_p50_ms": percentile(took, 0.5),
        "execution_p99_ms": percentile(took, 0.99),
        "pages_hit": hit / len(keys),
        "pages_read": read / len(keys),
    }


def index_levels(url: str) -> int:
    """The levels of the key table's unique index (root to leaves)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        row = conn.execute(
            "SELECT level + 1 FROM bt_metap('idempotency_keys_scope_operation_key')"
        ).fetchone()
        assert row is not None
        return int(row[0])


def timed(op: Callable[[str], Any], keys: list[str]) -> tuple[list[float], float, float]:
    """Latencies of ``op`` over ``keys``, with the client's and every PostgreSQL process's
    CPU seconds spent meanwhile."""
    latencies = []
    cpu, server = time.process_time(), every_postgres_cpu()
    for key in keys:
        began = time.perf_counter()
        op(key)
        latencies.append(time.perf_counter() - began)
    return latencies, time.process_time() - cpu, every_postgres_cpu() - server


def measure(
    name: str, ops: dict[str, tuple[Callable[[str], Any], Keys]], count: int
) -> dict[str, dict[str, float]]:
    """``count`` operations of each of ``ops``, in turns, blocks of BLOCK."""
    latencies: dict[str, list[float]] = {table: [] for table in ops}
    cpu = dict.fromkeys(ops, 0.0)
    server = dict.fromkeys(ops, 0.0)
    for block in range(0, count, BLOCK):
        order = list(ops) if block // BLOCK % 2 == 0 else list(reversed(ops))
        for table in order:
            op, key = ops[table]
            took, client, pg = timed(op, [key() for _ in range(min(BLOCK, count - block))])
            latencies[table] += took
            cpu[table] += client
            server[table] += pg
        print(f"\r  {name}: {min(block + BLOCK, count):,}/{count:,}", end="", flush=True)
    print()
    return {
        table: {
            "p50_ms": percentile(took, 0.5) * 1e3,
            "p99_ms": percentile(took, 0.99) * 1e3,
            "client_cpu_ms": cpu[table] / len(took) * 1e3,
            "server_cpu_ms": server[table] / len(took) * 1e3,
        }
        for table, took in latencies.items()
    }


def one_run(urls: dict[str, str], counts: dict[str, int], ops: int) -> dict[str, Any]:
    claimers = {table: claims.Claimer(url) for table, url in urls.items()}
    replayers = {table: Replayer(url) for table, url in urls.items()}
    engines = {table: EngineReplayer(url) for table, url in urls.items()}
    draw = random.Random()
    try:
        for table in urls:  # warm: caches, prepared statements, the indexes' upper levels
            for _ in range(300):
                claimers[table].run(str(uuid.uuid4()))
        claimed = measure(
            "claims",
            {t: (c.run, lambda: str(uuid.uuid4())) for t, c in claimers.items()},
            ops,
        )
        for table, url in urls.items():
            forget_claims(url)
            prewarm_recent(url)
            for _ in range(300):
                for replaying in (replayers[table], engines[table]):
                    replaying.run(fill_key(draw.randrange(counts[table]), counts[table]))
        big = counts["big"]
        recent = big - min(big, RECENT)

        def replays(by: dict[str, Any]) -> dict[str, tuple[Callable[[str], Any], Keys]]:
            return {
                "small": (by["small"].run, lambda: fill_key(draw.randrange(SMALL), SMALL)),
                "big, finished in the last minute": (
                    by["big"].run,
                    lambda: fill_key(draw.randrange(recent, big), big),
                ),
                "big, of any age": (by["big"].run, lambda: fill_key(draw.randrange(big), big)),
            }

        replayed = measure("replays", replays(replayers), ops)
        replayed_by_engine = measure("Engine.run replays", replays(engines), ops)
        explained = {
            "small": server_side(urls["small"], [fill_key(i, SMALL) for i in range(SMALL)][:500]),
            "big, finished in the last minute": server_side(
                urls["big"], [fill_key(draw.randrange(recent, big), big) for _ in range(500)]
            ),
            "big, of any age": server_side(
                urls["big"], [fill_key(draw.randrange(big), big) for _ in range(500)]
            ),
        }
    finally:
        for worker in [*claimers.values(), *replayers.values(), *engines.values()]:
            worker.close()
        for url in urls.values():
            forget_claims(url)
    return {
        "claim": claimed,
        "replay": replayed,
        "engine replay": replayed_by_engine,
        "replay_explained": explained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000_000, help="finished keys stored")
    parser.add_argument("--ops", type=int, default=20_000, help="claims and replays per table")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--shared-buffers",
        help="the server's shared_buffers (default: the README's, holding the indexes)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="shared_buffers in huge pages (huge_pages = on; the kernel's vm.nr_hugepages "
        "must hold them)",
    )
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    counts = {"small": SMALL, "big": args.keys}
    overrides = {"huge_pages": "on"} if args.huge_pages else {}
    if args.shared_buffers:
        overrides["shared_buffers"] = args.shared_buffers
    if args.huge_pages:
        require_huge_pages(claims.sized_settings(args.keys, overrides)["shared_buffers"])
    with claims.sized_server(args.keys, print, overrides) as admin:
        urls = {
            table: sa.make_url(admin)
            .set(database=claims.big_database_name(n))
            .render_as_string(hide_password=False)
            for table, n in counts.items()
        }
        for table, n in counts.items():
            seconds = claims.ensure_filled(admin, urls[table], n, False, print)
            if seconds:
                print(f"stored {n:,} keys in {seconds:.0f} s")
            forget_claims(urls[table])  # left by a run that was stopped
            claims.prewarm(urls[table])
            if table == "big" and prewarm_if_it_fits(urls[table]):
                print("the whole key table fits in shared_buffers: read into it")
        machine = facts.collect(HERE.parent, admin, None)
        levels = {table: index_levels(url) for table, url in urls.items()}
        with sa.create_engine(
            sa.make_url(urls["big"]).set(drivername="postgresql+psycopg")
        ).connect() as c:
            sizes: dict[str, Any] = dict(
                c.execute(
                    sa.text(
                        "SELECT 'table', pg_table_size('idempotency_keys') UNION ALL "
                        "SELECT 'indexes', pg_indexes_size('idempotency_keys')"
                    )
                ).all()
            )
        sizes["unique_index_levels"] = levels
        runs = []
        for r in range(args.runs):
            print(f"run {r + 1}/{args.runs}")
            runs.append(one_run(urls, counts, args.ops))
        machine["loadavg_at_end"] = facts.loadavg()
    write(args, machine, sizes, runs)


def require_huge_pages(shared_buffers: str) -> None:
    """Exit with what to run when the kernel keeps too few huge pages free for
    ``shared_buffers`` (PostgreSQL with ``huge_pages = on`` would refuse to start, its
    error out of sight); a size this cannot read is left to PostgreSQL."""
    size = re.fullmatch(r"\s*([0-9.]+)\s*(B|kB|MB|GB|TB)?\s*", shared_buffers, re.IGNORECASE)
    if size is None:
        return
    units = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, None: 8192}
    needed_bytes = float(size[1]) * units[size[2] and size[2].upper()]
    meminfo = {
        name: int(value.split()[0])
        for name, value in (
            line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines()
        )
    }
    page = meminfo.get("Hugepagesize", 2048) * 1024
    needed = int(needed_bytes * 1.03 // page) + 16  # and PostgreSQL's other shared memory
    available = meminfo.get("HugePages_Free", 0) - meminfo.get("HugePages_Rsvd", 0)
    if available < needed:
        total = meminfo.get("HugePages_Total", 0) + needed - available
        raise SystemExit(
            f"--huge-pages: the kernel has {available} huge pages to give, and "
            f"shared_buffers={shared_buffers} needs about {needed}: run `sysctl -w "
            f"vm.nr_hugepages={total}` as root first (and set it back after, to give the "
            "memory back)"
        )


def explained_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for series in runs[0]["replay_explained"]:
        figures = [
            statistics.median(run["replay_explained"][series][figure] for run in runs)
            for figure in ("execution_p50_ms", "execution_p99_ms", "pages_hit", "pages_read")
        ]
        rows.append(
            f"| {series} | {figures[0]:.3f} | {figures[1]:.3f} | "
            f"{figures[2]:.2f} | {figures[3]:.2f} |"
        )
    return rows


def write(
    args: argparse.Namespace,
    machine: dict[str, Any],
    sizes: dict[str, Any],
    runs: list[dict[str, Any]],
) -> None:
    rows = []
    summary: dict[str, Any] = {}
    for op in ("claim", "replay", "engine replay"):
        for series in [s for s in runs[0][op] if s != "small"]:
            what = op if series == "big" else f"{op} of a key {series.removeprefix('big, ')}"
            for figure in ("p50_ms", "p99_ms", "client_cpu_ms", "server_cpu_ms"):
                small = [run[op]["small"][figure] for run in runs]
                big = [run[op][series][figure] for run in runs]
                change = [100 * (b / s - 1) for b, s in zip(big, small, strict=True)]
                medians = statistics.median(small), statistics.median(big)
                summary[f"{what} {figure}"] = {"small": small, "big": big, "change_pct": change}
                rows.append(
                    f"| {what} | {figure.removesuffix('_ms').replace('_', ' ')} | "
                    f"{medians[0]:.3f} | {medians[1]:.3f} | "
                    f"{100 * (medians[1] / medians[0] - 1):+.1f} % "
                    f"({min(change):+.1f} to {max(change):+.1f}) |"
                )
    lines = [
        f"# The key table at {args.keys:,} keys against {SMALL:,}",
        "",
        f"`benchmarks/scale.py --keys {args.keys} --ops {args.ops} --runs {args.runs}"
        + (f" --shared-buffers {args.shared_buffers}" if args.shared_buffers else "")
        + (" --huge-pages" if args.huge_pages else "")
        + "`: "
        f"{args.ops:,} claims and {args.ops:,} replays per table per run, in turns; "
        "milliseconds, median of the runs; the change of the medians (the range of the "
        "runs' own changes). CPU is per operation: "
        "the client's, and every PostgreSQL process's on the machine.",
        "",
        f"The big table: {sizes['table'] / 2**30:.1f} GiB of rows, "
        f"{sizes['indexes'] / 2**30:.2f} GiB of indexes. The unique index's levels: "
        + ", ".join(
            f"{n} on the {table} table" for table, n in sizes["unique_index_levels"].items()
        )
        + ".",
        "",
        f"| operation | figure | {SMALL:,} keys | {args.keys:,} keys | change |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "The replay's statement on the server, `EXPLAIN (ANALYZE, BUFFERS)` of 500 keys of "
        "each kind after each run (median of the runs): its execution, and the pages a "
        "replay found in `shared_buffers` or read from the operating system.",
        "",
        "| replay of | execution p50, ms | p99, ms | pages found | pages read |",
        "|---|---|---|---|---|",
        *explained_rows(runs),
        "",
        *facts.markdown(machine),
        "",
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "scale.md").write_text("\n".join(lines))
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "facts": machine,
        "sizes": sizes,
        "runs": runs,
        "summary": summary,
    }
    (args.results / "scale.json").write_text(json.dumps(payload, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
