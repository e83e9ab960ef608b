"""What a request costs on Citus: the same operation on one plain PostgreSQL server and on
Citus clusters of one or more nodes, side by side in one run.

    python benchmarks/citus.py --citus-url postgresql://postgres@127.0.0.1:9700/rp \\
        [--citus-url URL ...] [--plain-url postgresql://postgres@127.0.0.1:5432/postgres]

Each ``--citus-url`` names a coordinator with the ``citus`` extension and its workers added
(Citus is in no registry this project installs from: bring your own cluster; see
docs/how-to/citus.md). The script migrates it with ``migrate --citus`` (idempotent) and
co-locates its own table; on the plain server it works in a database of its own, dropped at
the end.

The operation is the one docs/how-to/citus.md counts: an atomic phase that writes a row of
the request's scope and stages two jobs, a foreign step (an in-process stand-in), a phase
that stages one more job and returns 201. A fresh key per request, its scope one of 1,000
tenants at random, so that the requests spread over every shard. Per target, threads of this
process (``--clients``) send requests for ``--seconds``; targets take turns within each of
``--rounds`` rounds, the order rotated. Beside each rate: the latency, this process's CPU
per request and that of every PostgreSQL process on the machine (so, for that figure, have
the machine to yourself: the idle servers count too, little). On each cluster, the commands
the coordinator sends to its workers for one fresh request and one replay
(``citus.log_remote_commands``). Results are printed and written to
benchmarks/results/citus/citus.md.

Transport: the client's connection to every target is encrypted as its connection to the
plain server is (Citus turns TLS on for its nodes when its extension is created, and libpq
then encrypts a connection to the coordinator by default, which the plain server, without
TLS, is spared): a URL that names its own ``sslmode`` keeps it. Between the nodes each
cluster keeps its own ``citus.node_conninfo`` (Citus's default: ``sslmode=require``), which
the target's label names.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import facts
import sqlalchemy as sa
from measure import every_postgres_cpu, percentile

import recoverypoint as rp
from recoverypoint import distribute
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.migrate import upgrade
from recoverypoint.testing import temporary_database

ROOT = Path(__file__).resolve().parents[1]
TABLE = """
CREATE TABLE IF NOT EXISTS bench_citus_notes (
    scope text NOT NULL,
    key_id bigint NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (scope, key_id)
)
"""
TENANTS = 1_000


def operation(name: str) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("noted")
    def note(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute(
            "INSERT INTO bench_citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, %(b)s)",
            {"s": params["scope"], "k": tx.key_id, "b": params["body"]},
        )
        tx.stage_job("notify", {"n": 1})
        tx.stage_job("notify", {"n": 2})

    @op.foreign_step("called")
    def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.stage_job("notify", {"n": 3})
        return rp.Response(201, {"body": params["body"]})

    return op


@dataclass
class Target:
    label: str
    url: str
    db: sa.Engine
    engine: rp.Engine
    op: rp.Operation[Any]
    encrypted: bool = False  # the client's connection, for the plain server
    windows: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def request(self) -> rp.Outcome:
        scope = f"tenant-{random.randrange(TENANTS)}"
        params = {"scope": scope, "body": "x"}
        return self.engine.run(self.op, key=uuid.uuid4().hex, params=params, scope=scope)


ENCRYPTED = "SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)"


def plain_target(stack: ExitStack, server_url: str, clients: int) -> tuple[Target, str]:
    """The plain server's target, and the ``sslmode`` that gives a client's connection to
    the other targets the transport its connection here has."""
    url = stack.enter_context(temporary_database(server_url, prefix="rp_bench_citus"))
    upgrade(url)
    db = create_engine(url, pool_size=clients, max_overflow=0)
    stack.callback(db.dispose)
    with db.begin() as conn:
        conn.exec_driver_sql(TABLE)
        encrypted = bool(conn.exec_driver_sql(ENCRYPTED).scalar_one())
    target = _target("plain PostgreSQL", url, db)
    target.encrypted = encrypted
    return target, "require" if encrypted else "disable"


def citus_target(stack: ExitStack, url: str, clients: int, sslmode: str) -> Target:
    parsed = normalize_url(url)
    if "sslmode" not in parsed.query:
        parsed = parsed.update_query_dict({"sslmode": sslmode})
    url = parsed.render_as_string(hide_password=False)
    db = create_engine(url, pool_size=clients, max_overflow=0)
    stack.callback(db.dispose)
    with db.begin() as conn:
        conn.exec_driver_sql(TABLE)
    upgrade(url)
    distribute.distribute(db, ["bench_citus_notes"])
    with db.connect() as conn:
        workers, alone = conn.exec_driver_sql(
            "SELECT count(*) FILTER (WHERE groupid <> 0), "
            "bool_or(groupid = 0 AND shouldhaveshards) FROM pg_dist_node WHERE isactive"
        ).one()
        between = conn.exec_driver_sql("SHOW citus.node_conninfo").scalar_one()
    shape = "coordinator" + (" holding shards" if alone else "")
    if workers:
        shape += f" + {workers} worker{'s' * (workers != 1)}"
        settings = dict(p.split("=", 1) for p in between.split() if "=" in p)
        shape += f", sslmode={settings.get('sslmode', 'prefer')} between nodes"
    target = _target(f"Citus, {shape}", url, db)
    stack.callback(_clean, db, target.op.name)
    target.commands = remote_commands(target)
    return target


def _target(label: str, url: str, db: sa.Engine) -> Target:
    op = operation(f"bench_citus_{uuid.uuid4().hex[:8]}")
    engine = rp.Engine(db)
    engine.register(op)
    return Target(label, url, db, engine, op)


def _clean(db: sa.Engine, name: str) -> None:
    """The run's keys, jobs and rows out of the cluster, which stays."""
    with db.begin() as conn:
        conn.exec_driver_sql("DELETE FROM bench_citus_notes")
        conn.execute(
            sa.text(
                "DELETE FROM staged_jobs WHERE idempotency_key_id IN "
                "(SELECT id FROM idempotency_keys WHERE operation = :op)"
            ),
            {"op": name},
        )
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE operation = :op"), {"op": name})


def remote_commands(target: Target) -> dict[str, list[str]]:
    """What the coordinator sends its workers for one fresh request and its replay."""
    sent: list[str] = []

    def record(notice: Any) -> None:
        message = notice.message_primary or ""
        if message.startswith("issuing "):
            sent.append(message.removeprefix("issuing ").split("\n")[0][:160])

    db = create_engine(
        target.url, pool_size=1, connect_args={"options": "-c citus.log_remote_commands=on"}
    )
    sa.event.listen(db, "connect", lambda dbapi_conn, _: dbapi_conn.add_notice_handler(record))
    try:
        engine = rp.Engine(db)
        engine.register(target.op)
        found: dict[str, list[str]] = {}
        params = {"scope": "tenant-0", "body": "x"}
        key = uuid.uuid4().hex
        for kind in ("fresh", "replay"):
            sent.clear()
            engine.run(target.op, key=key, params=params, scope="tenant-0")
            found[kind] = list(sent)
        return found
    finally:
        db.dispose()


def window(target: Target, clients: int, seconds: float) -> dict[str, float]:
    """``clients`` threads sending fresh requests for ``seconds``, after a warm-up."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    deadline = [float("inf")]

    def client() -> None:
        try:
            for _ in range(5):
                target.request()
        except BaseException:
            start.abort()  # the window cannot open: main() raises BrokenBarrierError
            raise
        start.wait()
        mine, failed = [], 0
        while (began := time.perf_counter()) < deadline[0]:
            try:
                target.request()
            except Exception:  # a conflict retried past its budget: counted, not timed
                failed += 1
                continue
            mine.append(time.perf_counter() - began)
        with lock:
            latencies.extend(mine)
            errors[0] += failed

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    cpu, server, began = time.process_time(), every_postgres_cpu(), time.perf_counter()
    deadline[0] = began + seconds
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    cpu, server = time.process_time() - cpu, every_postgres_cpu() - server
    n = len(latencies) or 1
    return {
        "rate": len(latencies) / elapsed,
        "p50": percentile(latencies, 0.5) * 1000,
        "p99": percentile(latencies, 0.99) * 1000,
        "client_cpu": cpu / n * 1000,
        "server_cpu": server / n * 1000,
        "errors": float(errors[0]),
    }


@contextmanager
def targets(args: argparse.Namespace) -> Iterator[list[Target]]:
    clients = max(args.clients)
    with ExitStack() as stack:
        plain, sslmode = plain_target(stack, args.plain_url, clients)
        made = [plain]
        made += [citus_target(stack, url, clients, sslmode) for url in args.citus_url]
        yield made


def report(made: list[Target], args: argparse.Namespace, machine: dict[str, Any]) -> list[str]:
    machine["loadavg_at_end"] = facts.loadavg()
    lines = [
        "# Citus against one plain server (`benchmarks/citus.py`)",
        "",
        f"`{' '.join(['python', 'benchmarks/citus.py', *sys.argv[1:]])}`",
        "",
        *facts.markdown(machine),
        "",
        f"Median of {args.rounds} rounds of {args.seconds:g} s per target and client count "
        "(range in brackets); CPU per request in ms, the server's that of every PostgreSQL "
        "process on the machine. The client's connection to every target "
        f"{'with' if made[0].encrypted else 'without'} TLS, as its connection to the plain "
        "server; between a cluster's nodes, as its label says.",
        "",
        "| target | clients | requests/s | x plain | p50 ms | p99 ms | client CPU | "
        "server CPU | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = made[0]
    for target in made:
        for clients in args.clients:
            runs = target.windows[clients]

            def med(name: str, runs: list[dict[str, float]] = runs) -> float:
                return statistics.median(r[name] for r in runs)

            rates = [r["rate"] for r in runs]
            base = statistics.median(r["rate"] for r in plain.windows[clients])
            lines.append(
                f"| {target.label} | {clients} | {med('rate'):,.0f} "
                f"({min(rates):,.0f} to {max(rates):,.0f}) | {med('rate') / base:.2f} | "
                f"{med('p50'):.2f} | {med('p99'):.2f} | {med('client_cpu'):.2f} | "
                f"{med('server_cpu'):.2f} | {sum(r['errors'] for r in runs):.0f} |"
            )
    for target in made[1:]:
        for kind, commands in target.commands.items():
            lines += ["", f"{target.label}, a {kind} request: {len(commands)} remote commands", ""]
            lines += [f"{i}. `{command}`" for i, command in enumerate(commands, 1)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--citus-url", action="append", required=True)
    parser.add_argument("--plain-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    machine = facts.collect(ROOT, args.plain_url, None)
    with targets(args) as made:
        for round_ in range(args.rounds):
            turn = made[round_ % len(made) :] + made[: round_ % len(made)]
            for target in turn:
                for clients in args.clients:
                    figures = window(target, clients, args.seconds)
                    target.windows.setdefault(clients, []).append(figures)
                    print(
                        f"round {round_ + 1}/{args.rounds} {target.label}, {clients} clients: "
                        f"{figures['rate']:,.0f}/s",
                        flush=True,
                    )
        lines = report(made, args, machine)
    print("\n".join(lines))
    out = ROOT / "benchmarks" / "results" / "citus" / "citus.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
