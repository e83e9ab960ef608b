"""What one round trip to PostgreSQL costs beside a fresh request, both sides: the unit a
target in requests a second is paid in.

    .venv/bin/python benchmarks/round_trip.py --database-url URL [--rounds 5] [--calls 2000]

One client, one call at a time, four sides in turns within each round (the order rotates
from round to round, so drift of this shared machine falls on all four):

- a round trip: a prepared ``SELECT 1`` through libpq (psycopg's ``pq``) on a connection
  held open in autocommit, the least a statement can cost;
- a commit: a prepared one-row ``INSERT`` the same way, one round trip whose transaction
  writes and flushes the WAL, as each of a request's transactions does at its COMMIT;
- a fresh request of the hand-written reference (``flows.Reference``: four SERIALIZABLE
  transactions, 17 round trips);
- a fresh request through the sync ``Engine`` (``flows.RecoveryPointFlow``: two
  transactions, 8 round trips, as tests/test_round_trips.py counts).

The sides' names say the request is fresh; the round trip and the commit ignore the key.

For each: wall time, client CPU (this process, kernel included) and server CPU (every
PostgreSQL process on the machine, from ``/proc``: backends and the WAL writer alike) per
call, the medians of the rounds. ``/proc`` counts CPU in clock ticks (10 ms here), so the
round trip and the commit, each a fraction of a request, run ``UNIT_CALLS`` times as many
calls, to keep a tick below a quarter of a microsecond per call. Then each request in
round trips' worth of CPU, and what issue 41's 1.5 times the reference's rate asks of the
engine's request where the CPU sets the rate (8 and 32 clients on 2 cores: rate = cores /
CPU per request). A request that does not answer 201 as a fresh one stops the run. Needs
the server on this machine, and nothing else running on it (its CPU is counted whoever
spends it). Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import pq

sys.path.insert(0, str(Path(__file__).parent))

import facts as machine
from flows import SCHEMA, RecoveryPointFlow, Reference, ride_operation
from measure import every_postgres_cpu

import recoverypoint as rp
from recoverypoint.migrate import upgrade
from recoverypoint.testing import temporary_database

HERE = Path(__file__).resolve().parent
SIDES = ("round trip", "commit", "reference", "recoverypoint")
COMMITTED = (
    b"INSERT INTO bench_audit_records (action, data, resource_id) VALUES ('commit', '{}', 0)"
)
UNIT_CALLS = 20  # times --calls, for the round trip and the commit
TARGET = 1.5  # issue 41, item 1: the engine's rate over the reference's


def fresh(run: Callable[[str], Any]) -> Callable[[str], None]:
    """``run``, checked to answer a fresh request's 201: a replay or a failure timed as a
    fresh request would make the figures wrong without a sign."""

    def checked(key: str) -> None:
        answer = run(key)
        status = answer["status"] if isinstance(answer, dict) else answer.status
        if status != 201 or getattr(answer, "replayed", False):
            raise RuntimeError(f"a fresh request answered {answer!r}")

    return checked


class RoundTrip:
    """One prepared statement through libpq, in autocommit, on a connection of its own."""

    def __init__(self, url: str, statement: bytes) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.pgconn.prepare(b"round_trip", statement)

    def run(self, _key: str) -> None:
        result = self.conn.pgconn.exec_prepared(b"round_trip", [])
        if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            raise RuntimeError(f"the statement failed: {result.error_message!r}")

    def close(self) -> None:
        self.conn.close()


def timed(run: Callable[[str], object], calls: int) -> tuple[float, float, float]:
    """Wall, client CPU and server CPU per call of ``run`` with a fresh key, in µs."""
    keys = [uuid.uuid4().hex for _ in range(calls)]
    server, client, wall = every_postgres_cpu(), time.process_time(), time.perf_counter()
    for key in keys:
        run(key)
    wall, client = time.perf_counter() - wall, time.process_time() - client
    server = every_postgres_cpu() - server
    return wall * 1e6 / calls, client * 1e6 / calls, server * 1e6 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="per side and round")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    admin = sa.make_url(args.database_url).set(drivername="postgresql").render_as_string(False)
    facts = machine.collect(HERE.parent, admin, None)
    started = time.monotonic()
    with temporary_database(args.database_url, prefix="rp_round_trip") as made:
        url = sa.make_url(made).set(drivername="postgresql").render_as_string(False)
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(SCHEMA)
        with ExitStack() as stack:
            engine = rp.Engine(url)
            stack.callback(engine.dispose)
            operation = ride_operation()
            engine.register(operation)
            reference = stack.enter_context(closing(Reference(url)))
            sides: dict[str, Callable[[str], Any]] = {
                "round trip": stack.enter_context(closing(RoundTrip(url, b"SELECT 1"))).run,
                "commit": stack.enter_context(closing(RoundTrip(url, COMMITTED))).run,
                "reference": fresh(reference.run),
                "recoverypoint": fresh(RecoveryPointFlow(engine, operation).run),
            }
            calls = {side: args.calls for side in SIDES}
            calls["round trip"] = calls["commit"] = args.calls * UNIT_CALLS
            readings: dict[str, list[tuple[float, float, float]]] = {side: [] for side in SIDES}
            for run in sides.values():  # prepared statements, the pool, caches
                timed(run, 200)
            for round_ in range(args.rounds):
                order = SIDES[round_ % len(SIDES) :] + SIDES[: round_ % len(SIDES)]
                for name in order:
                    readings[name].append(timed(sides[name], calls[name]))
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    facts["loadavg_at_end"] = machine.loadavg()
    report = write(readings, facts, args, time.monotonic() - started)
    print(report)


def write(
    readings: dict[str, list[tuple[float, float, float]]],
    facts: dict[str, object],
    args: argparse.Namespace,
    took: float,
) -> str:
    median = {
        side: [statistics.median(reading[i] for reading in rows) for i in range(3)]
        for side, rows in readings.items()
    }
    unit = median["round trip"][1] + median["round trip"][2]
    lines = [
        "# A round trip beside a fresh request",
        "",
        f"Written by `benchmarks/round_trip.py` in {took / 60:.1f} min: one client, "
        f"{args.rounds} rounds of {args.calls} requests per side ({args.calls * UNIT_CALLS} "
        "round trips and commits), sides in turns; µs per call, "
        "the median of the rounds. Server CPU: every PostgreSQL process on the machine. "
        "Reported, never asserted.",
        "",
        *machine.markdown(facts),
        "",
        "| side | wall | client CPU | server CPU | CPU, both sides | in round trips' worth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side in SIDES:
        wall, client, server = median[side]
        lines.append(
            f"| {side} | {wall:.1f} | {client:.1f} | {server:.1f} | {client + server:.1f} "
            f"| {(client + server) / unit:.1f} |"
        )
    reference = sum(median["reference"][1:])
    engine = sum(median["recoverypoint"][1:])
    wanted = reference / TARGET
    lines += [
        "",
        f"Where the CPU sets the rate, the engine's is {reference / engine:.2f} times the "
        f"reference's. {TARGET} times would take a request of at most {wanted:.0f} µs of CPU, "
        f"{engine - wanted:.0f} µs less than now: {(engine - wanted) / unit:.1f} round trips' "
        "worth.",
    ]
    report = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "round_trip.md").write_text(report)
    return report


if __name__ == "__main__":
    main()
