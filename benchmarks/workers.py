"""How fast the workers go on this machine: the enqueuer's drain rate, the reaper's delete
rate and the completer's resume rate.

    python benchmarks/workers.py                      # embedded PostgreSQL
    python benchmarks/workers.py --database-url URL   # or a server of yours

Each run starts from rows planted with SQL in a fresh database (dropped at the end) and
times ``run_once()`` until nothing is left, with one worker and with several side by side
(threads of this process, each worker with its own connections, as separate instances
would have). The job handler and the operation's phases do no work of their own, so the
figures are the workers' own cost: claims, commits and round trips. Beside each rate, the
CPU per row of this process (the workers) and of every PostgreSQL process on the machine
(so, for that figure, have the server to yourself). Results are printed and written to
benchmarks/results/workers.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import psycopg
from measure import every_postgres_cpu

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.embedded import embedded_database
from recoverypoint.jobs import InProcessBackend, JobBackend
from recoverypoint.migrate import upgrade
from recoverypoint.workers import Completer, Enqueuer, Reaper, Worker

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Case:
    worker: str
    backend: str
    """Where the enqueuer publishes: "in-process" (a no-op handler) or "celery"."""
    plant: str
    """SQL that plants the rows to handle: %(rows)s of them over %(scopes)s scopes."""
    rows: int
    batch_size: int
    scopes: int = 1


@dataclass(frozen=True)
class Run:
    case: Case
    instances: int
    seconds: float
    cpu: float  # seconds of this process's CPU (the workers, every thread)
    server_cpu: float  # seconds of every PostgreSQL process's CPU on this machine

    @property
    def rate(self) -> float:
        return self.case.rows / self.seconds


def noop_operation() -> rp.Operation[Any]:
    """atomic → foreign → atomic, doing nothing but what the engine does."""
    op: rp.Operation[Any] = rp.Operation("bench")

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: Any) -> None:
        tx.state["reserved"] = True

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, str]:
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


def plant(url: str, sql: str, count: int, scopes: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql, {"rows": count, "scopes": scopes})
        conn.execute("VACUUM ANALYZE")


# Row n is in scope bench-<n modulo the scopes>.
STAGE_JOBS = """
    INSERT INTO staged_jobs (scope, job_name, job_args, job_key)
    SELECT 'bench-' || n %% %(scopes)s, 'bench', jsonb_build_object('n', n),
           'bench-' || gen_random_uuid()
    FROM generate_series(1, %(rows)s) AS n
"""

# Keys as clients left them: never resumed, last run an hour ago.
UNFINISHED_KEYS = """
    INSERT INTO idempotency_keys (scope, operation, idempotency_key, operation_version,
        request_method, request_path, request_params, fingerprint, last_run_at)
    SELECT 'bench-' || n %% %(scopes)s, 'bench', gen_random_uuid()::text, 1, 'POST',
           '/bench', '{}', 'fp', now() - interval '1 hour'
    FROM generate_series(1, %(rows)s) AS n
"""

# Keys finished four days ago, with a response as the engine stores it.
FINISHED_KEYS = """
    INSERT INTO idempotency_keys (scope, operation, idempotency_key, operation_version,
        request_method, request_path, request_params, fingerprint, recovery_point,
        response_status, response_headers, response_body, finished_at)
    SELECT 'bench-' || n %% %(scopes)s, 'bench', gen_random_uuid()::text, 1, 'POST',
           '/bench', '{}', 'fp', 'finished', 201, '{}', '{"charge": "ch_1"}',
           now() - interval '4 days'
    FROM generate_series(1, %(rows)s) AS n
"""


def timed(
    workers: list[Worker[Any]], handled: Callable[[Any], int]
) -> tuple[int, float, float, float]:
    """Run the workers' passes side by side until one comes back empty each: the rows
    handled, the seconds, and the CPU seconds of this process and of the server."""
    barrier = threading.Barrier(len(workers))

    def drain(worker: Worker[Any]) -> int:
        barrier.wait()
        total = 0
        while count := handled(worker.run_once()):
            total += count
        return total

    with ThreadPoolExecutor(len(workers)) as pool:
        cpu, server, began = time.process_time(), every_postgres_cpu(), time.perf_counter()
        rows = sum(pool.map(drain, workers))
        seconds = time.perf_counter() - began
        return rows, seconds, time.process_time() - cpu, every_postgres_cpu() - server


def bench(url: str, case: Case, instances: int, broker_url: str) -> Run:
    plant(url, case.plant, case.rows, case.scopes)
    with ExitStack() as stack:
        workers: list[Worker[Any]] = []
        for _ in range(instances):
            engine = rp.Engine(url, jobs=stack.enter_context(backend(case.backend, broker_url)))
            stack.callback(engine.dispose)
            engine.register(noop_operation())
            workers.append(make_worker(case, engine))
        handled, seconds, cpu, server_cpu = timed(workers, HANDLED[case.worker])
    if handled != case.rows:
        raise SystemExit(f"{case.worker}: handled {handled} of {case.rows} rows")
    return Run(case, instances, seconds, cpu, server_cpu)


@contextmanager
def backend(kind: str, broker_url: str) -> Iterator[JobBackend]:
    if kind == "in-process":
        yield InProcessBackend({"bench": lambda job: None})
        return
    from recoverypoint.integrations.celery import CeleryBackend

    app = celery_app(broker_url)
    queue = f"recoverypoint-bench-{secrets.token_hex(4)}"
    try:
        yield CeleryBackend(app, queue=queue)
    finally:
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(queue)
        app.close()


def celery_app(broker_url: str) -> Any:
    """A Celery app whose publishes return once RabbitMQ confirms them (the celery extra)."""
    from celery import Celery  # type: ignore[import-untyped]

    app = Celery("recoverypoint_bench", broker=broker_url)
    app.conf.broker_transport_options = {"confirm_publish": True}
    return app


def broker_answers(broker_url: str) -> bool:
    app = celery_app(broker_url)
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:
        print(f"no Celery runs: {broker_url}: {exc}")
        return False
    finally:
        app.close()
    return True


def make_worker(case: Case, engine: rp.Engine) -> Worker[Any]:
    if case.worker == "enqueuer":
        return Enqueuer(engine, batch_size=case.batch_size)
    if case.worker == "reaper":
        return Reaper(engine, batch_size=case.batch_size)
    return Completer(engine, batch_size=case.batch_size, min_age=0)


HANDLED: dict[str, Callable[[Any], int]] = {
    "enqueuer": lambda result: result.published,
    "reaper": lambda result: result.finished,
    "completer": lambda result: result.finished,
}


@contextmanager
def database(server: str | None) -> Iterator[str]:
    """A fresh, migrated database, dropped at the end."""
    with ExitStack() as stack:
        server = server or stack.enter_context(embedded_database())
        admin = normalize_url(server).set(drivername="postgresql")
        name = f"rp_bench_{secrets.token_hex(4)}"
        with psycopg.connect(admin.render_as_string(False), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            url = admin.set(database=name).render_as_string(False)
            upgrade(url)
            yield url
        finally:
            with psycopg.connect(admin.render_as_string(False), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def markdown(runs: list[Run], server_version: str) -> str:
    lines = [
        f"Workers on {os.cpu_count()} CPU cores, {platform.python_implementation()} "
        f"{platform.python_version()}, {server_version}, {date.today()}.",
        "Several instances are threads of one process, each with its own connections and "
        "(Celery) broker connection. The in-process job handler and the operation's phases "
        "do no work of their own: the figures are the workers' cost. Celery publishes go to "
        "RabbitMQ on this machine with publisher confirms, one round trip each. Threads share "
        "one interpreter lock, so the completer, mostly Python, gains less from them than "
        "processes would: run completer instances as processes to use more cores. The "
        "server CPU is every PostgreSQL process's on this machine; `scopes` is how many the "
        "rows are spread over (n modulo scopes), so fewer rows than scopes fill that many.",
        "",
        "| worker | measures | job backend | instances | batch size | rows | scopes | seconds "
        "| rows/s | worker CPU µs/row | server CPU µs/row |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    what = {
        "enqueuer": "staged jobs published and deleted",
        "reaper": "finished keys deleted",
        "completer": "keys resumed through 3 phases",
    }
    for run in runs:
        case = run.case
        lines.append(
            f"| {case.worker} | {what[case.worker]} | "
            f"{case.backend if case.worker == 'enqueuer' else ''} | {run.instances} | "
            f"{case.batch_size} | {case.rows:,} | {case.scopes:,} | {run.seconds:.2f} | "
            f"{run.rate:,.0f} | {1e6 * run.cpu / case.rows:,.1f} | "
            f"{1e6 * run.server_cpu / case.rows:,.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("RECOVERYPOINT_DATABASE_URL"))
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--jobs", type=int, default=20_000, help="staged jobs to drain")
    parser.add_argument("--keys", type=int, default=100_000, help="finished keys to reap")
    parser.add_argument("--resumes", type=int, default=2_000, help="unfinished keys to resume")
    parser.add_argument("--instances", type=int, default=3, help="for the side-by-side runs")
    parser.add_argument(
        "--scopes",
        type=int,
        default=10_000,
        help="the rows of each worker spread over this many scopes too (users, tenants)",
    )
    args = parser.parse_args()

    cases = [
        Case("enqueuer", "in-process", STAGE_JOBS, args.jobs, 100),
        Case("enqueuer", "in-process", STAGE_JOBS, args.jobs, 1000),
        *(
            [Case("enqueuer", "celery", STAGE_JOBS, args.jobs, 100)]
            if broker_answers(args.broker_url)
            else []
        ),
        Case("reaper", "in-process", FINISHED_KEYS, args.keys, 1000),
        Case("completer", "in-process", UNFINISHED_KEYS, args.resumes, 10),
        # The same rows spread over many scopes: on one server each worker's batch takes
        # rows of every scope at once (on Citus, a transaction per scope).
        Case("enqueuer", "in-process", STAGE_JOBS, args.jobs, 100, args.scopes),
        Case("reaper", "in-process", FINISHED_KEYS, args.keys, 1000, args.scopes),
        Case("completer", "in-process", UNFINISHED_KEYS, args.resumes, 10, args.scopes),
    ]
    runs: list[Run] = []
    with database(args.database_url) as url:
        with psycopg.connect(url) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        server_version = f"PostgreSQL {version[0] if version else '?'}"
        for case in cases:
            for instances in sorted({1, args.instances}):
                run = bench(url, case, instances, args.broker_url)
                print(
                    f"{case.worker:9} {case.backend:10} x{instances} batch {case.batch_size:>4}: "
                    f"{case.rows:>7,} rows in {run.seconds:6.2f} s = {run.rate:8,.0f}/s, "
                    f"CPU {1e6 * run.cpu / case.rows:,.1f} + server "
                    f"{1e6 * run.server_cpu / case.rows:,.1f} µs/row",
                    flush=True,
                )
                runs.append(run)

    report = markdown(runs, server_version)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workers.md").write_text(report)
    print()
    print(report)
    print(f"written: {RESULTS / 'workers.md'}")


if __name__ == "__main__":
    main()
