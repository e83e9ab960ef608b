"""Side-by-side benchmark: the hand-written reference flow, recoverypoint and DBOS.

    python benchmarks/run.py                      # embedded PostgreSQL
    python benchmarks/run.py --database-url URL   # or a server of yours

Every system runs the same Rocket Rides flow (see flows.py) with a fresh key per request,
on one PostgreSQL, interleaved (A B C, then B C A, …) so drift of this shared machine
cancels out. Also measured: replaying a finished key, the claim alone, and the claim with
1,000,000 keys stored. Results go to benchmarks/results/ as Markdown, JSON and a PNG plot;
then workers.py measures the workers' rates (results/workers.md) unless --no-workers.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))

from flows import SCHEMA, DBOSFlow, RecoveryPointFlow, Reference, ride_operation

import recoverypoint as rp
from recoverypoint import store
from recoverypoint.database import normalize_url
from recoverypoint.embedded import embedded_database
from recoverypoint.migrate import upgrade

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("reference", "recoverypoint", "dbos")


@dataclass
class Sample:
    """All requests of one system at one concurrency, over every round."""

    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else 0.0


def drive(run: Callable[[str], Any], clients: int, seconds: float) -> Sample:
    """``clients`` threads, each sending fresh-key requests until the time is up."""
    sample = Sample()
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    deadline = 0.0

    def client() -> None:
        mine: list[float] = []
        start.wait()
        while (now := time.perf_counter()) < deadline:
            run(str(uuid.uuid4()))
            mine.append(time.perf_counter() - now)
        with lock:
            sample.latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    deadline = began + seconds
    start.wait()
    for thread in threads:
        thread.join()
    sample.seconds = time.perf_counter() - began
    sample.requests = len(sample.latencies)
    return sample


class Systems:
    """Builds each system's request function for a given number of clients."""

    def __init__(self, url: str, dbos_url: str) -> None:
        self.url = url
        self.engine = rp.Engine(sa.create_engine(normalize_url(url), pool_size=40))
        self.operation = ride_operation()
        self.engine.register(self.operation)
        self.dbos = DBOSFlow(str(normalize_url(url).render_as_string(False)), dbos_url)

    def run_fn(self, system: str, clients: int) -> tuple[Callable[[str], Any], Callable[[], None]]:
        if system == "reference":
            # One connection per client, as a hand-written service would keep.
            local = threading.local()
            conns: list[Reference] = []

            def run(key: str) -> Any:
                if not hasattr(local, "ref"):
                    local.ref = Reference(self.url)
                    conns.append(local.ref)
                return local.ref.run(key)

            return run, lambda: [c.close() for c in conns] and None
        if system == "recoverypoint":
            flow = RecoveryPointFlow(self.engine, self.operation)
            return flow.run, self.engine.db.dispose
        return self.dbos.run, self.dbos.db.dispose

    def close(self) -> None:
        self.dbos.close()
        self.engine.dispose()


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}")
    sys.stderr.flush()


def compare(
    systems: Systems, concurrency: list[int], rounds: int, seconds: float
) -> dict[tuple[str, int], Sample]:
    samples = {(s, c): Sample() for s in SYSTEMS for c in concurrency}
    total, done = rounds * len(concurrency) * len(SYSTEMS), 0
    for round_ in range(rounds):
        order = SYSTEMS[round_ % 3 :] + SYSTEMS[: round_ % 3]  # rotate who goes first
        for clients in concurrency:
            for system in order:
                progress(done, total, f"round {round_ + 1}: {system} x{clients}")
                run, cleanup = systems.run_fn(system, clients)
                result = drive(run, clients, seconds)
                cleanup()
                merged = samples[(system, clients)]
                merged.requests += result.requests
                merged.seconds += result.seconds
                merged.latencies.extend(result.latencies)
                done += 1
    progress(total, total, "done")
    sys.stderr.write("\n")
    return samples


def timed(fn: Callable[[], Any], n: int) -> Sample:
    sample = Sample()
    for _ in range(n):
        began = time.perf_counter()
        fn()
        sample.latencies.append(time.perf_counter() - began)
    sample.requests, sample.seconds = n, sum(sample.latencies)
    return sample


def claim_alone(engine: rp.Engine, n: int) -> Sample:
    """The claim statement in its own SERIALIZABLE transaction, fresh key each time."""

    def once() -> None:
        request = store.ClaimRequest(
            scope="bench",
            operation="claim_only",
            key=str(uuid.uuid4()),
            version=1,
            method="POST",
            path="/x",
            params_json="{}",
            fingerprint="f",
            token=uuid.uuid4(),
        )
        engine._transact(lambda conn: store.claim(conn, request))

    return timed(once, n)


def fill_keys(url: str, count: int) -> None:
    """``count`` finished keys, as a busy service would hold within its retention."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO idempotency_keys (scope, operation, idempotency_key, operation_version,
                request_method, request_path, request_params, fingerprint, recovery_point,
                response_status, response_body, finished_at)
            SELECT 'filler-' || (i %% 1000), 'bench_create_ride', md5(i::text), 1, 'POST',
                '/rides', '{}', md5(i::text), 'finished', 201, '{}', now()
            FROM generate_series(1, %s) AS i
            """,
            (count,),
        )
        conn.execute("VACUUM ANALYZE idempotency_keys")
        # Flush the load's dirty pages now, so the measurement after it does not pay for
        # the checkpoint it triggered (nor for the full-page writes that follow one).
        conn.execute("CHECKPOINT")


@contextmanager
def databases(server: str | None) -> Iterator[tuple[str, str]]:
    """Two fresh databases (ours and DBOS's system database), dropped at the end."""
    with ExitStack() as stack:
        server = server or stack.enter_context(embedded_database())
        admin = normalize_url(server).set(drivername="postgresql")
        name = f"rp_bench_{secrets.token_hex(4)}"
        with psycopg.connect(admin.render_as_string(False), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
            conn.execute(f'CREATE DATABASE "{name}_dbos"')
        try:
            yield (
                admin.set(database=name).render_as_string(False),
                admin.set(database=f"{name}_dbos").render_as_string(False),
            )
        finally:
            with psycopg.connect(admin.render_as_string(False), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.execute(f'DROP DATABASE IF EXISTS "{name}_dbos" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("RECOVERYPOINT_DATABASE_URL"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per system, per round")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--keys", type=int, default=1_000_000, help="for the claim-scaling run")
    parser.add_argument(
        "--no-workers", action="store_true", help="skip the workers' rates (workers.py)"
    )
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]

    with databases(args.database_url) as (url, dbos_url):
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        systems = Systems(url, dbos_url)
        try:
            samples = compare(systems, concurrency, args.rounds, args.seconds)
            flow = RecoveryPointFlow(systems.engine, systems.operation)
            finished = str(uuid.uuid4())
            flow.run(finished)
            replay = timed(lambda: flow.run(finished), 2000)
            sys.stderr.write("claim latency, empty table …\n")
            claim_empty = claim_alone(systems.engine, 2000)
            sys.stderr.write(f"storing {args.keys:,} keys …\n")
            fill_keys(url, args.keys)
            claim_alone(systems.engine, 500)  # warm the caches, as for the first measurement
            claim_full = claim_alone(systems.engine, 2000)
        finally:
            systems.close()

    report = Report(samples, concurrency, replay, claim_empty, claim_full, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.md").write_text(report.markdown())
    (RESULTS / "results.json").write_text(json.dumps(report.figures(), indent=2))
    report.plot(RESULTS / "results.png")
    print(report.markdown())
    print(f"written: {RESULTS / 'results.md'}, results.json, results.png")
    if not args.no_workers:
        # The enqueuer's drain rate, the reaper's delete rate, the completer's resume rate.
        command = [sys.executable, str(Path(__file__).with_name("workers.py"))]
        if args.database_url:
            command += ["--database-url", args.database_url]
        subprocess.run(command, check=True)


@dataclass
class Report:
    samples: dict[tuple[str, int], Sample]
    concurrency: list[int]
    replay: Sample
    claim_empty: Sample
    claim_full: Sample
    args: argparse.Namespace

    def ratio(self, a: str, b: str, clients: int) -> float:
        return self.samples[(a, clients)].rate / self.samples[(b, clients)].rate

    def markdown(self) -> str:
        lines = [
            f"Rounds: {self.args.rounds} x {self.args.seconds:g} s per system and concurrency, "
            "interleaved; fresh key per request.",
            "",
            "| concurrency | system | requests/s | p50 ms | p99 ms |",
            "|---:|---|---:|---:|---:|",
        ]
        for clients in self.concurrency:
            for system in SYSTEMS:
                s = self.samples[(system, clients)]
                lines.append(
                    f"| {clients} | {system} | {s.rate:,.0f} | {s.percentile(0.5):.2f} "
                    f"| {s.percentile(0.99):.2f} |"
                )
        lines += [
            "",
            "| concurrency | recoverypoint / reference | recoverypoint / DBOS |",
            "|---:|---:|---:|",
        ]
        for clients in self.concurrency:
            lines.append(
                f"| {clients} | {self.ratio('recoverypoint', 'reference', clients):.2f}x "
                f"| {self.ratio('recoverypoint', 'dbos', clients):.2f}x |"
            )
        growth = self.claim_full.percentile(0.5) / self.claim_empty.percentile(0.5) - 1
        lines += [
            "",
            "| measurement | p50 ms | p99 ms |",
            "|---|---:|---:|",
            f"| replay of a finished key (concurrency 1) | {self.replay.percentile(0.5):.3f} "
            f"| {self.replay.percentile(0.99):.3f} |",
            f"| claim alone, near-empty table | {self.claim_empty.percentile(0.5):.3f} "
            f"| {self.claim_empty.percentile(0.99):.3f} |",
            f"| claim alone, {self.args.keys:,} keys stored "
            f"| {self.claim_full.percentile(0.5):.3f} | {self.claim_full.percentile(0.99):.3f} |",
            "",
            f"Claim p50 with {self.args.keys:,} keys vs near-empty: {growth:+.1%}.",
            "",
        ]
        return "\n".join(lines)

    def figures(self) -> dict[str, Any]:
        return {
            "flow": {
                f"{system}@{clients}": {
                    "requests_per_second": s.rate,
                    "p50_ms": s.percentile(0.5),
                    "p99_ms": s.percentile(0.99),
                    "requests": s.requests,
                }
                for (system, clients), s in self.samples.items()
            },
            "replay_ms": {"p50": self.replay.percentile(0.5), "p99": self.replay.percentile(0.99)},
            "claim_empty_ms": {
                "p50": self.claim_empty.percentile(0.5),
                "p99": self.claim_empty.percentile(0.99),
            },
            "claim_full_ms": {
                "p50": self.claim_full.percentile(0.5),
                "p99": self.claim_full.percentile(0.99),
            },
            "keys_stored": self.args.keys,
        }

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for system in SYSTEMS:
            rates = [self.samples[(system, c)].rate for c in self.concurrency]
            p99 = [self.samples[(system, c)].percentile(0.99) for c in self.concurrency]
            left.plot(self.concurrency, rates, marker="o", label=system)
            right.plot(self.concurrency, p99, marker="o", label=system)
        left.set(
            title="Throughput (fresh key per request)",
            xlabel="concurrent clients",
            ylabel="requests/s",
            xscale="log",
        )
        right.set(title="p99 latency", xlabel="concurrent clients", ylabel="ms", xscale="log")
        for ax in (left, right):
            ax.set_xticks(self.concurrency, [str(c) for c in self.concurrency])
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
