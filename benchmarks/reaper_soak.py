"""Whether the reaper keeps up with a steady stream of finished keys, without bloat: keys
finish at ``--rate`` per second, spread over ``--scopes`` scopes, for ``--minutes``; the
reaper, as shipped (its interval, batch size, autovacuum as migrated), deletes them once
they are ``--retention`` seconds old. Every ``--sample`` seconds: the key table's size, its
live and dead rows, the keys past their retention still there (the reaper's backlog),
autovacuum's runs, and ``key_generations``, which records each deleted key's next
generation for ``--generations-retention`` seconds (30 days as shipped; with a few minutes,
the soak shows whether the reaper's pruning of them keeps up too).

    .venv/bin/python benchmarks/reaper_soak.py --minutes 20
    .venv/bin/python benchmarks/reaper_soak.py --minutes 20 --generations-retention 300

Without ``--database-url`` it runs on a private PostgreSQL of this machine's binaries with
PostgreSQL's defaults (autovacuum on), started and removed here; with one, on that
server, whose autovacuum setting the report shows (where it is off, the reaper vacuums
the table itself after a pass that deleted 10,000 keys).

The keys are copies of one a real request finished (the Rocket Rides shape: its params,
state and response), inserted in batches ten times a second: the engine on this machine
could not finish 2,000 a second, and what is measured is the reaper's side. Writes
``results/reaper_soak.md`` and ``.json``. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import facts as machine
import sqlalchemy as sa
from claims import binaries, free_port, initdb

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.generations import DEFAULT_GENERATIONS_RETENTION
from recoverypoint.testing import temporary_database
from recoverypoint.workers import Reaper

HERE = Path(__file__).resolve().parent

# Copies of the template key (kept in a table of its own, out of the reaper's reach),
# finished now, each of a scope drawn from --scopes and a key of its own. The columns not
# named keep the template's (its params, state, response).
_COPY = """
INSERT INTO idempotency_keys ({columns}, scope, idempotency_key, created_at, last_run_at,
    finished_at, point_reached_at)
SELECT {columns}, 'user_' || floor(random() * :scopes)::int, md5(random()::text || i),
    now(), now(), now(), now()
FROM soak_template AS t, generate_series(1, :n) AS i
"""

_SAMPLE = """
SELECT pg_total_relation_size('idempotency_keys'), pg_relation_size('idempotency_keys'),
    s.n_live_tup, s.n_dead_tup, s.autovacuum_count,
    (SELECT count(*) FROM idempotency_keys
     WHERE finished_at < now() - make_interval(secs => :retention)),
    pg_total_relation_size('key_generations'), g.n_live_tup, s.vacuum_count, g.n_dead_tup,
    (SELECT count(*) FROM key_generations
     WHERE deleted_at < now() - make_interval(secs => :generations_retention))
FROM pg_stat_user_tables AS s, pg_stat_user_tables AS g
WHERE s.relname = 'idempotency_keys' AND g.relname = 'key_generations'
"""
FIELDS = (
    "keys_total_bytes",
    "keys_heap_bytes",
    "live",
    "dead",
    "autovacuums",
    "backlog",
    "generations_bytes",
    "generations_live",
    "vacuums",
    "generations_dead",
    "generations_backlog",
)


def ride_operation() -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("rides")

    @op.atomic_phase("ride_created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        tx.state["ride_id"] = 4711

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"ride_id": 4711, "charge_id": "ch_3Nf0xY2eZvKYlo2C0x9sKq1"})

    return op


def template_key(engine: rp.Engine, op: rp.Operation[Any]) -> list[str]:
    """A key a real request finished, copied to ``soak_template``; the columns its copies
    take from it."""
    params = {
        "origin_lat": 37.7749,
        "origin_lon": -122.4194,
        "target_lat": 37.3382,
        "target_lon": -121.8863,
        "user": "user_1",
    }
    engine.run(op, key="template", params=params, scope="template", request=rp.Request())
    with engine.db.begin() as conn:
        conn.execute(sa.text("CREATE TABLE soak_template AS TABLE idempotency_keys"))
        columns = conn.execute(
            sa.text(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name = 'idempotency_keys' AND is_identity = 'NO' "
                "AND is_generated = 'NEVER'"
            )
        ).scalars()
        own = {"scope", "idempotency_key", "created_at", "last_run_at", "finished_at"}
        copied = [c for c in columns if c not in own | {"point_reached_at"}]
    return copied


class Producer(threading.Thread):
    """Inserts finished keys at ``rate`` a second, ten batches a second, catching up when a
    batch came late; counts what it inserted."""

    def __init__(self, db: sa.Engine, statement: str, params: dict[str, Any], rate: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.db, self.statement, self.params, self.rate = db, sa.text(statement), params, rate
        self.inserted = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        began = time.monotonic()
        while not self.stopped.wait(0.1):
            due = int((time.monotonic() - began) * self.rate) - self.inserted
            if due > 0:
                with self.db.begin() as conn:
                    conn.execute(self.statement, {**self.params, "n": due})
                self.inserted += due


def sample(db: sa.Engine, retention: float, generations_retention: float) -> dict[str, int]:
    with db.connect() as conn:
        row = conn.execute(
            sa.text(_SAMPLE),
            {"retention": retention, "generations_retention": generations_retention},
        ).one()
    return dict(zip(FIELDS, (int(v or 0) for v in row), strict=True))


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def report(args: argparse.Namespace, samples: list[dict[str, Any]], facts: dict[str, Any]) -> str:
    steady = [s for s in samples if s["t"] >= args.retention + 2 * args.interval]
    lines = [
        "# The reaper under a steady stream of finished keys",
        "",
        f"Written by `benchmarks/reaper_soak.py` ({args.rate:,} finished keys a second over "
        f"{args.scopes:,} scopes for {args.minutes} minutes; retention {args.retention} s, "
        f"deleted keys' generations {args.generations_retention:,.0f} s; "
        f"the reaper every {args.interval} s, batches of {Reaper.default_batch_size}; "
        "autovacuum as migrated). Reported, never asserted.",
        "",
        *machine.markdown(facts),
        "",
        f"The server's autovacuum: {args.autovacuum}.",
        "",
        "| minute | inserted a second | key table MiB (heap) | live rows | dead rows | "
        "past retention (backlog) | vacuums: autovacuum · the reaper's | "
        "key_generations MiB · live rows · dead rows · past retention |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in samples:
        lines.append(
            f"| {s['t'] / 60:.1f} | {s['rate']:,.0f} | {mib(s['keys_total_bytes'])} "
            f"({mib(s['keys_heap_bytes'])}) | {s['live']:,} | {s['dead']:,} | "
            f"{s['backlog']:,} | {s['autovacuums']} · {s['vacuums']} | "
            f"{mib(s['generations_bytes'])} · {s['generations_live']:,} · "
            f"{s['generations_dead']:,} · {s['generations_backlog']:,} |"
        )
    if len(steady) >= 2:
        first, last = steady[0], steady[-1]
        lines += [
            "",
            f"From minute {first['t'] / 60:.1f} (one retention and two passes in) to the end: "
            f"key table {mib(first['keys_total_bytes'])} → {mib(last['keys_total_bytes'])} "
            f"MiB, backlog {first['backlog']:,} → {last['backlog']:,} keys (median "
            f"{statistics.median(s['backlog'] for s in steady):,.0f}), dead rows median "
            f"{statistics.median(s['dead'] for s in steady):,.0f}; key_generations "
            f"{mib(first['generations_bytes'])} → {mib(last['generations_bytes'])} MiB.",
        ]
    kept = [s for s in samples if s["t"] >= args.generations_retention + 2 * args.interval]
    if len(kept) >= 2:
        first, last = kept[0], kept[-1]
        lines += [
            "",
            f"From minute {first['t'] / 60:.1f} (the generations' retention and two passes "
            f"in) to the end: key_generations "
            f"{mib(first['generations_bytes'])} → {mib(last['generations_bytes'])} MiB, "
            f"{first['generations_live']:,} → {last['generations_live']:,} live rows, "
            f"past their retention median "
            f"{statistics.median(s['generations_backlog'] for s in kept):,.0f} (at most "
            f"{max(s['generations_backlog'] for s in kept):,}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", help="a server to run on (default: a private one)")
    parser.add_argument("--rate", type=int, default=2000, help="finished keys a second")
    parser.add_argument("--scopes", type=int, default=10_000, help="scopes they spread over")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--retention", type=float, default=60.0, help="seconds a key is kept")
    parser.add_argument(
        "--generations-retention",
        type=float,
        default=DEFAULT_GENERATIONS_RETENTION.total_seconds(),
        help="seconds a deleted key's generation is kept (default: as shipped, 30 days)",
    )
    parser.add_argument(
        "--interval", type=float, default=Reaper.default_interval, help="between passes"
    )
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    with ExitStack() as stack:
        server = args.database_url or stack.enter_context(private_server())
        soak(args, server)


@contextmanager
def private_server() -> Iterator[str]:
    """A PostgreSQL of this machine's binaries with PostgreSQL's defaults, in a temporary
    folder; its admin URL; stopped and removed at the end."""
    bindir, as_user = binaries()
    with tempfile.TemporaryDirectory(prefix="rp-soak-") as folder:
        Path(folder).chmod(0o755)  # the server's user reaches its data through it
        data = Path(folder) / "data"
        data.mkdir()
        initdb(data)
        port = free_port()
        options = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={data}"
        ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-w"]
        log = str(data / "server.log")
        subprocess.run([*ctl, "-l", log, "-o", options, "start"], check=True, capture_output=True)
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*ctl, "-m", "fast", "stop"], check=True, capture_output=True)


def soak(args: argparse.Namespace, server: str) -> None:
    facts = machine.collect(HERE.parent, server, None)
    admin = create_engine(server)
    with admin.connect() as conn:
        args.autovacuum = conn.execute(sa.text("SHOW autovacuum")).scalar_one()
    admin.dispose()
    samples: list[dict[str, Any]] = []
    with temporary_database(server, prefix="rp_soak") as url:
        migrate.upgrade(url)
        db = create_engine(url, pool_size=4)
        engine = rp.Engine(db)
        op = ride_operation()
        engine.register(op)
        columns = template_key(engine, op)
        producer = Producer(
            db,
            _COPY.format(columns=", ".join(columns)),
            {"scopes": args.scopes},
            args.rate,
        )
        retention = timedelta(seconds=args.retention)
        reaper = Reaper(
            engine,
            retention=retention,
            abandoned_retention=retention,
            generations_retention=timedelta(seconds=args.generations_retention),
        )
        reaping = threading.Thread(
            target=reaper.run_forever, args=(args.interval,), name="reaper", daemon=True
        )
        began = time.monotonic()
        producer.start()
        reaping.start()
        inserted_before, at_before = 0, began
        try:
            while (now := time.monotonic()) - began < args.minutes * 60:
                time.sleep(max(0.0, args.sample - (now - at_before)))
                at = time.monotonic()
                figures: dict[str, Any] = sample(db, args.retention, args.generations_retention)
                figures["t"] = at - began
                figures["rate"] = (producer.inserted - inserted_before) / (at - at_before)
                inserted_before, at_before = producer.inserted, at
                samples.append(figures)
                print(
                    f"{figures['t'] / 60:5.1f} min: {figures['rate']:7,.0f}/s in, "
                    f"table {mib(figures['keys_total_bytes'])} MiB, "
                    f"live {figures['live']:,}, dead {figures['dead']:,}, "
                    f"backlog {figures['backlog']:,}, autovacuums {figures['autovacuums']}",
                    flush=True,
                )
        finally:
            producer.stopped.set()
            reaper.stop()
            producer.join()
            reaping.join()
            db.dispose()
    facts["loadavg_at_end"] = machine.loadavg()
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "reaper_soak.md").write_text(report(args, samples, facts))
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.results / "reaper_soak.json").write_text(
        json.dumps(
            {"settings": settings, "machine": facts, "samples": samples}, indent=1, default=str
        )
    )
    print(f"written: {args.results / 'reaper_soak.md'}")


if __name__ == "__main__":
    main()
