"""Replays of one finished key, two commits of recoverypoint side by side.

    .venv/bin/python benchmarks/replay_ab.py --base 58724cb \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres

Each round runs one process per commit, in turns (A B, then B A, …), so drift of this
shared machine falls on both. A process finishes one key through the benchmark's Rocket
Rides operation (flows.py), replays it ``--replays`` times, and reports the p50 and p99
of one replay and its client CPU. Both commits run on the schema of this checkout,
migrated into a database made for the run and dropped after it
(:func:`recoverypoint.testing.temporary_database`). Prints the median and
range over the rounds; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import sqlalchemy as sa
from flows import SCHEMA

from recoverypoint.migrate import upgrade
from recoverypoint.testing import temporary_database

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# One process's measurement; the recoverypoint it imports is the one on its PYTHONPATH.
CHILD = """
import json, sys, time
sys.path.insert(0, {benchmarks!r})
from run import Replayers
replayers = Replayers({url!r}, None)
run, key = replayers.runs["recoverypoint"], replayers.keys["recoverypoint"]
for _ in range(300):
    run(key)
latencies = []
began = time.process_time()
for _ in range({replays}):
    start = time.perf_counter()
    run(key)
    latencies.append(time.perf_counter() - start)
cpu = (time.process_time() - began) / {replays}
latencies.sort()
n = len(latencies)
print(json.dumps([latencies[n // 2], latencies[min(n - 1, int(n * 0.99))], cpu]))
replayers.close()
"""


def source_of(rev: str, into: Path) -> Path:
    """The ``src`` directory of commit ``rev``, written out under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def measure(src: Path, url: str, replays: int) -> list[float]:
    code = CHILD.format(benchmarks=str(HERE), url=url, replays=replays)
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the replay process for {src} failed:\n{done.stderr[-3000:]}")
    return [float(x) * 1000 for x in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--head", default="", help="the other commit (default: this checkout)")
    parser.add_argument("--database-url", default=os.environ.get("RECOVERYPOINT_DATABASE_URL"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replays", type=int, default=4000, help="per process")
    args = parser.parse_args()
    if not args.database_url:
        parser.error("--database-url (or RECOVERYPOINT_DATABASE_URL) is required")
    if args.head == args.base:
        parser.error("--head and --base name the same commit: there is nothing to compare")
    with (
        tempfile.TemporaryDirectory() as tmp,
        temporary_database(args.database_url, prefix="rp_replay_ab") as made,
    ):
        # libpq's form: the reference flow connects with psycopg alone.
        url = sa.make_url(made).set(drivername="postgresql").render_as_string(False)
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(SCHEMA)
        trees = {args.base: source_of(args.base, Path(tmp) / "base")}
        head = args.head or "this checkout"
        if args.head:
            trees[head] = source_of(args.head, Path(tmp) / "head")
        else:
            trees[head] = REPO / "src"
        results: dict[str, list[list[float]]] = {label: [] for label in trees}
        labels = list(trees)
        for round_ in range(args.rounds):
            for label in labels if round_ % 2 == 0 else labels[::-1]:
                results[label].append(measure(trees[label], url, args.replays))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{args.rounds} rounds of {args.replays} replays; median (min to max), ms\n")
    print("| commit | p50 | p99 | client CPU per replay |\n|---|---|---|---|")
    for label, rows in results.items():
        cells = []
        for column in range(3):
            values = [row[column] for row in rows]
            cells.append(
                f"{statistics.median(values):.3f} ({min(values):.3f} to {max(values):.3f})"
            )
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
