"""Side-by-side benchmark: the hand-written reference flow, the work alone, recoverypoint and DBOS.

    python benchmarks/run.py --database-url URL   # a server on this machine (CPU is read
                                                  # from /proc); without it, embedded
    python benchmarks/run.py --seconds 1 --rounds 1 --runs 1 --no-workers   # a quick try

Every system runs the same Rocket Rides flow (see flows.py) with a fresh key per request,
on one PostgreSQL, interleaved (A B C D, then B C D A, …) so drift of this shared machine
cancels out; each timed window starts with its connections open and warm, and reports the
client's and the server's CPU per request beside requests/s (see measure.py). Also
measured: replaying a finished key beside Redis lookups, and the claim alone in an empty
key table and in one holding ``--big-keys`` finished keys. The whole comparison is
repeated ``--runs`` times; the results (median and range across runs, with the machine's
facts) go to benchmarks/results/ as Markdown, JSON and a PNG plot; then workers.py
measures the workers' rates (results/workers.md) unless --no-workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))

import claims
import facts as machine
from flows import (
    SCHEMA,
    DBOSFlow,
    PhaseAPI,
    PowertoolsStyle,
    PreparedSelect,
    RecoveryPointFlow,
    RedisGet,
    Reference,
    WorkOnly,
    ride_operation,
)
from measure import Meter, PostgresCPU, Progress, RedisCPU, Window, drive
from report import Report

import recoverypoint as rp
from recoverypoint import observe as rp_observe
from recoverypoint.database import normalize_url
from recoverypoint.embedded import embedded_database
from recoverypoint.migrate import upgrade

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent
SYSTEMS = (
    "reference",
    "work-only",
    "recoverypoint",
    "recoverypoint-sqlalchemy",
    "recoverypoint-observed",
    "dbos",
)

Clients = list[Callable[[str], Any]]


class System:
    """Opens a system for one timed window (``clients`` request functions, connections
    open and pooled) and closes it after."""

    name: str

    def open(self, clients: int) -> Clients:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def warm_pool(db: sa.Engine, clients: int) -> None:
    """Open ``clients`` pooled connections at once and give them back to the pool."""
    conns = [db.connect() for _ in range(clients)]
    for conn in conns:
        conn.close()


# The flows by hand, by system name: the reference, and the work alone without the key.
BY_HAND: dict[str, type[Reference]] = {"reference": Reference, "work-only": WorkOnly}


class ReferenceSystem(System):
    """A flow by hand (:data:`BY_HAND`), one connection per client."""

    def __init__(self, url: str, name: str = "reference") -> None:
        self.url, self.name = url, name
        self.flow = BY_HAND[name]
        self.refs: list[Reference] = []

    def open(self, clients: int) -> Clients:
        # One connection per client, as a hand-written service would keep.
        self.refs = [self.flow(self.url) for _ in range(clients)]
        return [ref.run for ref in self.refs]

    def close(self) -> None:
        for ref in self.refs:
            ref.close()
        self.refs = []


class RecoveryPointSystem(System):
    """``fast``: phases on ``tx.execute``, else on SQLAlchemy. ``observed``: the fast path
    with the Prometheus and OpenTelemetry observers on, to show what the extras cost."""

    def __init__(self, url: str, *, fast: bool, observed: bool = False) -> None:
        self.url, self.fast, self.observed = url, fast, observed
        self.name = (
            "recoverypoint-observed"
            if observed
            else "recoverypoint"
            if fast
            else "recoverypoint-sqlalchemy"
        )
        self.db: sa.Engine | None = None

    def open(self, clients: int) -> Clients:
        # A pool as large as the number of clients, opened now: nothing connects in the window.
        self.db = sa.create_engine(
            normalize_url(self.url), pool_size=clients + 4, max_overflow=4, pool_use_lifo=True
        )
        engine = rp.Engine(self.db, observer=observers() if self.observed else None)
        operation = ride_operation(
            "bench_create_ride" if self.fast else "bench_create_ride_sa", fast=self.fast
        )
        engine.register(operation)
        warm_pool(self.db, clients)
        flow = RecoveryPointFlow(engine, operation)
        return [flow.run] * clients

    def close(self) -> None:
        if self.db is not None:
            self.db.dispose()
            self.db = None


def observers() -> rp_observe.Observer:
    """Both observers, as ``pip install 'recoverypoint[metrics,otel]'`` gives them: metrics
    into a registry, spans through the OpenTelemetry API, which records nothing until the
    application installs an SDK (that cost is the SDK's, and the application's choice)."""
    from prometheus_client import CollectorRegistry

    from recoverypoint.integrations.otel import OtelObserver
    from recoverypoint.integrations.prometheus import PrometheusObserver

    return rp_observe.combine(PrometheusObserver(CollectorRegistry()), OtelObserver())


class DBOSSystem(System):
    """DBOS is launched for each of its windows and destroyed after it: its background
    threads would otherwise take CPU from the other systems' windows."""

    name = "dbos"

    def __init__(self, url: str, system_url: str) -> None:
        self.url = str(normalize_url(url).render_as_string(False))
        self.system_url = system_url
        self.flow: DBOSFlow | None = None

    def open(self, clients: int) -> Clients:
        self.flow = DBOSFlow(self.url, self.system_url, pool_size=clients + 4)
        warm_pool(self.flow.db, clients)
        system = self.flow.system_engine()
        if system is not None and isinstance(system.pool, sa.QueuePool):
            # The clients' workflows and DBOS's background threads share this pool (no
            # overflow): open every connection its threads are not holding.
            warm_pool(system, system.pool.size() - system.pool.checkedout())
        return [self.flow.run] * clients

    def close(self) -> None:
        if self.flow is not None:
            self.flow.close()
            self.flow = None


class LogToProgress(logging.Handler):
    """Warnings of psycopg and recoverypoint, printed between progress lines (the first
    three of each kind) and counted for the results."""

    LOGGERS = ("psycopg", "recoverypoint")

    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.WARNING)
        self.progress = progress
        self.counts: Counter[str] = Counter()
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        kind = f"{record.name}: {record.msg}"
        self.counts[kind] += 1
        if self.counts[kind] <= 3:
            self.progress.note(f"{record.levelname} {record.name}: {record.getMessage()}"[:300])


def fresh_key() -> str:
    return str(uuid.uuid4())


def constant(key: str) -> Callable[[], str]:
    return lambda: key


def compare(
    systems: list[System],
    concurrency: list[int],
    args: argparse.Namespace,
    meter: Meter,
    progress: Progress,
    run_index: int,
) -> dict[str, Window]:
    """Every system at every concurrency, ``args.rounds`` times, interleaved and rotated."""
    totals = {f"{s.name}@{c}": Window() for s in systems for c in concurrency}
    for round_ in range(args.rounds):
        turn = (run_index * args.rounds + round_) % len(systems)
        order = systems[turn:] + systems[:turn]  # rotate who goes first
        for clients in concurrency:
            for system in order:
                progress.step(
                    f"run {run_index + 1}/{args.runs} round {round_ + 1}/{args.rounds}: "
                    f"{system.name} x{clients}"
                )
                try:
                    run = system.open(clients)
                    window = drive(
                        run,
                        fresh_key,
                        meter,
                        seconds=args.seconds,
                        warmup=args.warmup,
                        cpus=client_cpus(args),
                    )
                finally:
                    system.close()
                totals[f"{system.name}@{clients}"].add(window)
    return totals


class Replayers:
    """Each replay system, open for the whole replay measurement, with a finished key."""

    def __init__(self, url: str, redis_client: Any) -> None:
        self.stack = ExitStack()
        self.runs: dict[str, Callable[[str], Any]] = {}
        self.keys: dict[str, str] = {}
        self.servers: dict[str, str] = {}
        # recoverypoint: the fast-path operation, one pooled connection.
        db = sa.create_engine(normalize_url(url), pool_size=2)
        self.stack.callback(db.dispose)
        engine = rp.Engine(db)
        operation = ride_operation()
        engine.register(operation)
        flow = RecoveryPointFlow(engine, operation)
        self._add("recoverypoint", flow.run, "postgres")
        # The floor a replay is judged against: the same finished key's stored answer read
        # by one prepared SELECT.
        floor = PreparedSelect(url, flow.scope, operation.name)
        self.stack.callback(floor.close)
        self.runs["prepared-select"] = floor.run
        self.keys["prepared-select"] = self.keys["recoverypoint"]
        self.servers["prepared-select"] = "postgres"
        ref = Reference(url)
        self.stack.callback(ref.close)
        self._add("reference", ref.run, "postgres")
        if redis_client is not None:
            prefix = f"rpbench:{secrets.token_hex(4)}:"
            self.stack.callback(lambda: _delete_prefix(redis_client, prefix))
            response = {"status": 201, "body": {"ride_id": 1, "charge_id": "ch_1"}}
            for name, cls in (("redis-get", RedisGet), ("powertools-style", PowertoolsStyle)):
                lookup = cls(redis_client, prefix)
                key = fresh_key()
                lookup.store(key, response)
                self.runs[name], self.keys[name], self.servers[name] = lookup.run, key, "redis"

    def _add(self, name: str, run: Callable[[str], Any], server: str) -> None:
        key = fresh_key()
        run(key)  # the first request finishes the key; every later one replays it
        self.runs[name], self.keys[name], self.servers[name] = run, key, server

    def close(self) -> None:
        self.stack.close()


def _delete_prefix(client: Any, prefix: str) -> None:
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)


def blocks(total: int, size: int) -> list[int]:
    return [min(size, total - done) for done in range(0, total, size)]


def interleaved(
    runs: dict[str, Callable[[str], Any]],
    keys: dict[str, Callable[[], str]],
    servers: dict[str, str],
    total: int,
    meter: Meter,
    progress: Progress,
    label: str,
    cpus: set[int] | None,
) -> dict[str, Window]:
    """``total`` sequential requests per system, in blocks, the systems taking turns."""
    out = {name: Window() for name in runs}
    names = list(runs)
    for i, size in enumerate(blocks(total, BLOCK)):
        progress.step(f"{label}: block {i + 1}")
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            window = drive(
                [runs[name]], keys[name], meter, server=servers[name], count=size, cpus=cpus
            )
            out[name].add(window)
    return out


BLOCK = 500


def figures(windows: dict[str, Window]) -> dict[str, dict[str, float | None]]:
    return {name: w.figures() for name, w in windows.items()}


def errors(windows: dict[str, Window]) -> dict[str, dict[str, str]]:
    return {n: {"first_error": w.first_error} for n, w in windows.items() if w.first_error}


@contextmanager
def databases(server: str | None) -> Iterator[tuple[str, str, str, str]]:
    """The admin URL and three fresh databases (the flows', DBOS's system database, and an
    empty key table for the claim), dropped at the end."""
    with ExitStack() as stack:
        server = server or stack.enter_context(embedded_database())
        admin = normalize_url(server).set(drivername="postgresql")
        name = f"rp_bench_{secrets.token_hex(4)}"
        names = (name, f"{name}_dbos", f"{name}_claims")
        admin_url = admin.render_as_string(False)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            for db in names:
                conn.execute(f'CREATE DATABASE "{db}"')
        try:
            url, dbos_url, claims_url = (
                admin.set(database=db).render_as_string(False) for db in names
            )
            yield admin_url, url, dbos_url, claims_url
        finally:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                for db in names:
                    conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def redis_connect(url: str | None, progress: Progress) -> tuple[Any, str | None]:
    if not url:
        return None, None
    try:
        import redis
    except ImportError:
        progress.note("no Redis figures: the redis package is not installed (the bench extra)")
        return None, None
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        version = client.info("server")["redis_version"]
    except Exception as exc:
        progress.note(f"no Redis figures: {url}: {exc}")
        return None, None
    return client, f"Redis {version}"


def dbos_available() -> bool:
    try:
        import dbos  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("RECOVERYPOINT_DATABASE_URL"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="'' to skip")
    parser.add_argument("--runs", type=int, default=3, help="the whole comparison, repeated")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per run")
    parser.add_argument("--seconds", type=float, default=3.0, help="per system, per round")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"a subset of {','.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--warmup", type=int, default=6, help="untimed requests per client before each window"
    )
    parser.add_argument("--replays", type=int, default=3000, help="per replay system, per run")
    parser.add_argument("--claims", type=int, default=10000, help="per key table, per run")
    parser.add_argument(
        "--big-keys",
        type=int,
        default=1_000_000,
        help="finished keys stored for the claim (0: skip); the target is 10000000. The "
        "filled database is kept (rp_bench_keys_<N>) and reused by later runs",
    )
    parser.add_argument("--refill", action="store_true", help="rebuild the kept big-keys database")
    parser.add_argument(
        "--no-sized-server",
        action="store_true",
        help="skip the claim on a private server configured as the README says (this "
        "machine's PostgreSQL binaries, shared_buffers holding the key table's indexes)",
    )
    parser.add_argument(
        "--drop-big-keys", action="store_true", help="drop the big-keys database at the end"
    )
    parser.add_argument(
        "--no-workers", action="store_true", help="skip the workers' rates (workers.py)"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where results.md/json/png go"
    )
    parser.add_argument(
        "--pin-client",
        type=int,
        metavar="CPU",
        help="run the client threads on this CPU only (Linux), so that the kernel's placement "
        "of clients and server processes does not decide the result (see README.md)",
    )
    return parser.parse_args()


def client_cpus(args: argparse.Namespace) -> set[int] | None:
    """The CPUs the client threads run on; None: wherever the kernel puts them."""
    return None if args.pin_client is None else {args.pin_client}


def check_pin(cpu: int | None) -> None:
    """Refuse a ``--pin-client`` CPU this process may not run on, before any thread would
    fail on it."""
    if cpu is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("--pin-client needs Linux (os.sched_setaffinity); run without it")
    usable = sorted(os.sched_getaffinity(0))
    if cpu not in usable:
        raise SystemExit(
            f"--pin-client {cpu}: this process may run on CPUs {usable} only; pick one of them"
        )


def main() -> None:
    args = parse_args()
    check_pin(args.pin_client)
    began = time.perf_counter()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    wanted = [s for s in args.systems.split(",") if s]
    unknown = set(wanted) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    if "dbos" in wanted and not dbos_available():
        sys.stderr.write("dbos is not installed (pip install -e '.[bench]'): skipping it\n")
        wanted.remove("dbos")

    per_run = (
        args.rounds * len(concurrency) * len(wanted)
        + len(blocks(args.replays, BLOCK))
        + (len(blocks(args.claims, BLOCK)) if args.claims else 0)
    )
    fills = (2 - args.no_sized_server) if args.big_keys else 0
    progress = Progress(per_run * args.runs + fills)
    logged = LogToProgress(progress)

    with ExitStack() as stack:
        admin_url, url, dbos_url, claims_url = stack.enter_context(databases(args.database_url))
        redis_client, redis_version = redis_connect(args.redis_url, progress)
        facts = machine.collect(REPO, admin_url, redis_version)
        upgrade(url)
        upgrade(claims_url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        fill_seconds = 0.0
        big_url = ""
        # The claim's key tables: name -> (URL, holds stored keys, whose server CPU counts).
        tables: dict[str, tuple[str, bool, str]] = {"empty": (claims_url, False, "postgres")}
        if args.big_keys:
            big_url = str(
                sa.make_url(admin_url)
                .set(database=claims.big_database_name(args.big_keys))
                .render_as_string(False)
            )
            progress.step(f"storing {args.big_keys:,} keys (cached after the first run)")
            fill_seconds = claims.ensure_filled(
                admin_url, big_url, args.big_keys, args.refill, progress.show
            )
            if fill_seconds:
                progress.note(f"stored {args.big_keys:,} keys in {fill_seconds:.0f} s")
            tables["stored"] = (big_url, True, "postgres")
            if not args.no_sized_server:
                progress.step(f"the sized server: {args.big_keys:,} keys (cached)")
                tables.update(sized_tables(stack, args, progress))
        ours = {sa.make_url(u).database for u in (url, dbos_url, claims_url, big_url) if u}
        postgres_cpu = PostgresCPU(admin_url, {d for d in ours if d})
        if not postgres_cpu.local:
            progress.note("the server is not on this machine: no server CPU figures")
        meter = Meter(postgres_cpu, RedisCPU(redis_client) if redis_client else None)
        systems: list[System] = []
        for name in wanted:
            if name in BY_HAND:
                systems.append(ReferenceSystem(url, name))
            elif name == "dbos":
                systems.append(DBOSSystem(url, dbos_url))
            else:
                systems.append(
                    RecoveryPointSystem(
                        url,
                        fast=name != "recoverypoint-sqlalchemy",
                        observed=name == "recoverypoint-observed",
                    )
                )

        runs: list[dict[str, Any]] = []
        try:
            for r in range(args.runs):
                flow = compare(systems, concurrency, args, meter, progress, r)
                run: dict[str, Any] = {"flow": figures(flow), "errors": errors(flow)}
                replayers = Replayers(url, redis_client)
                try:
                    replays = interleaved(
                        replayers.runs,
                        {n: constant(k) for n, k in replayers.keys.items()},
                        replayers.servers,
                        args.replays,
                        meter,
                        progress,
                        f"run {r + 1}/{args.runs} replays",
                        client_cpus(args),
                    )
                finally:
                    replayers.close()
                run["replay"] = figures(replays)
                run["errors"].update(errors(replays))
                if args.claims:
                    run["claims"] = measure_claims(tables, args, meter, progress, r)
                runs.append(run)
        finally:
            postgres_cpu.close()
            for system in systems:
                system.close()
        if args.drop_big_keys and big_url:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(
                    f'DROP DATABASE IF EXISTS "{sa.make_url(big_url).database}" WITH (FORCE)'
                )
    if args.drop_big_keys:
        shutil.rmtree(claims.sized_directory(args.big_keys), ignore_errors=True)
    progress.finish()

    facts["loadavg_at_end"] = machine.loadavg()
    settings = {
        "command": "python benchmarks/run.py " + shlex.join(sys.argv[1:]),
        "runs": args.runs,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "concurrency": concurrency,
        "systems": [s.name for s in systems],
        "warmup": args.warmup,
        "replays": args.replays,
        "claims": args.claims,
        "big_keys": args.big_keys,
        "big_keys_fill_seconds": round(fill_seconds, 1),
        "big_keys_cached": bool(args.big_keys) and not fill_seconds,
        "sized_server": (
            claims.sized_settings(args.big_keys)
            if args.big_keys and not args.no_sized_server
            else None
        ),
        "phase_api": phase_api(),
        "client_cpus": "any" if args.pin_client is None else [args.pin_client],
        "warnings_logged": dict(logged.counts.most_common(20)),
        "wall_minutes": (time.perf_counter() - began) / 60,
    }
    report = Report(runs, settings, facts, [s.name for s in systems], concurrency)
    out: Path = args.results
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(report.markdown())
    (out / "results.json").write_text(json.dumps(report.json(), indent=2) + "\n")
    plotted = report.plot(out / "results.png")
    print(report.markdown())
    print(
        f"written: {out / 'results.md'}, results.json"
        + (", results.png" if plotted else " (no plot: matplotlib is not installed)")
    )
    if not args.no_workers:
        # The enqueuer's drain rate, the reaper's delete rate, the completer's resume rate.
        command = [sys.executable, str(Path(__file__).with_name("workers.py"))]
        if args.database_url:
            command += ["--database-url", args.database_url]
        subprocess.run(command, check=True)


def phase_api() -> str:
    seen = PhaseAPI.seen
    if "tx.execute" in seen:
        return "`tx.execute` (psycopg)"
    return "`tx.connection` (SQLAlchemy: this checkout's AtomicContext has no `execute`)"


def sized_tables(
    stack: ExitStack, args: argparse.Namespace, progress: Progress
) -> dict[str, tuple[str, bool, str]]:
    """The claim's empty and stored key tables on a private server configured as the
    README's database settings say (``claims.sized_server``), started for the whole run;
    none without this machine's PostgreSQL binaries."""
    if shutil.which("pg_config") is None:
        progress.note(
            "no sized server: pg_config is not on the PATH (PostgreSQL's server package "
            "provides it); the claim is measured on this server only"
        )
        return {}
    admin = stack.enter_context(claims.sized_server(args.big_keys, progress.show))
    empty, stored = (
        str(sa.make_url(admin).set(database=name).render_as_string(False))
        for name in ("rp_bench_claims", claims.big_database_name(args.big_keys))
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute('DROP DATABASE IF EXISTS "rp_bench_claims" WITH (FORCE)')
        conn.execute('CREATE DATABASE "rp_bench_claims"')
    upgrade(empty)
    seconds = claims.ensure_filled(admin, stored, args.big_keys, args.refill, progress.show)
    if seconds:
        progress.note(f"stored {args.big_keys:,} keys on the sized server in {seconds:.0f} s")
    claims.prewarm(stored)
    return {"sized empty": (empty, False, "sized"), "sized stored": (stored, True, "sized")}


def measure_claims(
    tables: dict[str, tuple[str, bool, str]],
    args: argparse.Namespace,
    meter: Meter,
    progress: Progress,
    run_index: int,
) -> dict[str, dict[str, float | None]]:
    """The claim alone in each key table, in turns."""
    claimers = {name: claims.Claimer(url) for name, (url, _, _) in tables.items()}
    try:
        # Warm each: caches, prepared statements, the big index's upper levels.
        for claimer in claimers.values():
            for _ in range(300):
                claimer.run(fresh_key())
        windows = interleaved(
            {n: c.run for n, c in claimers.items()},
            {n: fresh_key for n in claimers},
            {name: server for name, (_, _, server) in tables.items()},
            args.claims,
            meter,
            progress,
            f"run {run_index + 1}/{args.runs} claims",
            client_cpus(args),
        )
    finally:
        for claimer in claimers.values():
            claimer.close()
        for url, big, _ in tables.values():
            claims.forget_claims(url, big=big)
    return figures(windows)


if __name__ == "__main__":
    main()
