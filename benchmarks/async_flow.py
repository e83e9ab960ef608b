"""The fresh-key Rocket Rides flow on asyncio, four ways, side by side in one run.

* ``recoverypoint``: ``rp.AsyncEngine`` running ``async_inflight.async_ride_operation`` (the
  flow of ``flows.py`` with async phases);
* ``psycopg``: the flow by hand on psycopg's ``AsyncConnection``, as ``flows.Reference``
  does it on threads: claim, the ride and its audit record, the charge outside any
  transaction, the charge recorded, a job staged and the answer stored, four SERIALIZABLE
  transactions, each retried on 40001, a connection taken from the pool for each;
* ``asyncpg``: the same by hand on an ``asyncpg`` pool (its defaults: statements prepared
  and cached per connection, the connection reset when it goes back);
* ``sync``: ``rp.Engine`` in client threads (``flows.ride_operation``), for its CPU per
  request beside the others'.

Every side has ``--pool`` connections (24), opened before its window. The windows take
turns (rotated each round), ``--rounds`` per run and ``--runs`` runs; every figure is per run
and reported as the median and range of the runs. ``--loop uvloop`` runs the async sides on
uvloop (uvicorn's default when it is installed), ``--loop both`` each run on either loop.
Writes ``results/async_flow.md`` and ``.json``. Nothing here asserts a speed::

    .venv/bin/python benchmarks/async_flow.py \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import platform
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
from async_inflight import async_ride_operation
from flows import PARAMS, SCHEMA, charge, ride_operation
from measure import every_postgres_cpu
from psycopg.errors import SerializationFailure
from sqlalchemy.ext import asyncio as sa_async

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.testing import temporary_database

WARMUP = 6  # requests per client before the window opens (psycopg prepares on the 5th)

CLAIM_SELECT = (
    "SELECT id, recovery_point, locked_at, response_code, response_body "
    "FROM rr_idempotency_keys WHERE user_id = {} AND idempotency_key = {}"
)
CLAIM_UPDATE = "UPDATE rr_idempotency_keys SET last_run_at = now(), locked_at = now() WHERE id = {}"
CLAIM_INSERT = (
    "INSERT INTO rr_idempotency_keys (idempotency_key, locked_at, recovery_point, "
    "request_method, request_params, request_path, user_id) "
    "VALUES ({}, now(), 'started', 'POST', {}, '/rides', 1) "
    "RETURNING id, recovery_point, locked_at, response_code, response_body"
)
RIDE_INSERT = (
    "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) VALUES ({}, {}, {}) RETURNING id"
)
AUDIT_INSERT = (
    "INSERT INTO bench_audit_records (action, data, resource_id) VALUES ('ride.created', {}, {})"
)
POINT_UPDATE = "UPDATE rr_idempotency_keys SET recovery_point = {} WHERE id = {}"
CHARGE_UPDATE = "UPDATE bench_rides SET charge_id = {} WHERE id = {}"
JOB_INSERT = "INSERT INTO rr_staged_jobs (job_name, job_args) VALUES ('send_ride_receipt', {})"
FINISH_UPDATE = (
    "UPDATE rr_idempotency_keys SET locked_at = NULL, recovery_point = 'finished', "
    "response_code = 201, response_body = {} WHERE id = {}"
)


def _psycopg(statement: str) -> str:
    return statement.format(*["%s"] * statement.count("{}"))


def _asyncpg(statement: str) -> str:
    return statement.format(*[f"${n}" for n in range(1, statement.count("{}") + 1)])


class PsycopgByHand:
    """The flow by hand on psycopg's AsyncConnection; the pool a queue of connections."""

    def __init__(self, url: str, pool: int) -> None:
        self.url, self.size = url, pool
        self.idle: asyncio.Queue[psycopg.AsyncConnection[Any]] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.size):
            conn = await psycopg.AsyncConnection.connect(self.url)
            await conn.set_isolation_level(psycopg.IsolationLevel.SERIALIZABLE)
            self.idle.put_nowait(conn)

    async def _tx(self, work: Callable[[psycopg.AsyncCursor[Any]], Awaitable[Any]]) -> Any:
        conn = await self.idle.get()
        try:
            while True:
                try:
                    async with conn.transaction():
                        return await work(conn.cursor())
                except SerializationFailure:
                    continue
        finally:
            self.idle.put_nowait(conn)

    async def run(self, key: str) -> dict[str, Any]:
        params = json.dumps(PARAMS)

        async def claim(cur: psycopg.AsyncCursor[Any]) -> Any:
            await cur.execute(_psycopg(CLAIM_SELECT), (1, key))
            row = await cur.fetchone()
            if row is not None:
                await cur.execute(_psycopg(CLAIM_UPDATE), (row[0],))
                return row
            await cur.execute(_psycopg(CLAIM_INSERT), (key, params))
            return await cur.fetchone()

        key_id, point, _, code, body = await self._tx(claim)
        if point == "finished":
            return {"status": code, "body": body}

        async def create_ride(cur: psycopg.AsyncCursor[Any]) -> int:
            await cur.execute(
                _psycopg(RIDE_INSERT), (key, PARAMS["origin_lat"], PARAMS["origin_lon"])
            )
            ride_id: int = (await cur.fetchone())[0]  # type: ignore[index]
            await cur.execute(_psycopg(AUDIT_INSERT), (params, ride_id))
            await cur.execute(_psycopg(POINT_UPDATE), ("ride_created", key_id))
            return ride_id

        ride_id = await self._tx(create_ride)
        charge_id = charge(f"rocket-rides-atomic-{key_id}")

        async def record_charge(cur: psycopg.AsyncCursor[Any]) -> None:
            await cur.execute(_psycopg(CHARGE_UPDATE), (charge_id, ride_id))
            await cur.execute(_psycopg(POINT_UPDATE), ("charge_created", key_id))

        await self._tx(record_charge)
        response = json.dumps({"ride_id": ride_id, "charge_id": charge_id})

        async def finish(cur: psycopg.AsyncCursor[Any]) -> None:
            await cur.execute(_psycopg(JOB_INSERT), (json.dumps({"ride_id": ride_id}),))
            await cur.execute(_psycopg(FINISH_UPDATE), (response, key_id))

        await self._tx(finish)
        return {"status": 201, "body": response}

    async def close(self) -> None:
        while not self.idle.empty():
            await self.idle.get_nowait().close()


class AsyncpgByHand:
    """The same flow by hand on an asyncpg pool, as its documentation writes one."""

    def __init__(self, url: str, pool: int) -> None:
        self.url, self.size = url, pool
        self.pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self.pool = await asyncpg.create_pool(self.url, min_size=self.size, max_size=self.size)

    async def _tx(self, work: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        assert self.pool is not None
        async with self.pool.acquire() as conn:
            while True:
                try:
                    async with conn.transaction(isolation="serializable"):
                        return await work(conn)
                except asyncpg.SerializationError:
                    continue

    async def run(self, key: str) -> dict[str, Any]:
        params = json.dumps(PARAMS)

        async def claim(conn: asyncpg.Connection) -> Any:
            row = await conn.fetchrow(_asyncpg(CLAIM_SELECT), 1, key)
            if row is not None:
                await conn.execute(_asyncpg(CLAIM_UPDATE), row[0])
                return row
            return await conn.fetchrow(_asyncpg(CLAIM_INSERT), key, params)

        key_id, point, _, code, body = await self._tx(claim)
        if point == "finished":
            return {"status": code, "body": body}

        async def create_ride(conn: asyncpg.Connection) -> int:
            ride_id: int = await conn.fetchval(
                _asyncpg(RIDE_INSERT), key, PARAMS["origin_lat"], PARAMS["origin_lon"]
            )
            await conn.execute(_asyncpg(AUDIT_INSERT), params, ride_id)
            await conn.execute(_asyncpg(POINT_UPDATE), "ride_created", key_id)
            return ride_id

        ride_id = await self._tx(create_ride)
        charge_id = charge(f"rocket-rides-atomic-{key_id}")

        async def record_charge(conn: asyncpg.Connection) -> None:
            await conn.execute(_asyncpg(CHARGE_UPDATE), charge_id, ride_id)
            await conn.execute(_asyncpg(POINT_UPDATE), "charge_created", key_id)

        await self._tx(record_charge)
        response = json.dumps({"ride_id": ride_id, "charge_id": charge_id})

        async def finish(conn: asyncpg.Connection) -> None:
            await conn.execute(_asyncpg(JOB_INSERT), json.dumps({"ride_id": ride_id}))
            await conn.execute(_asyncpg(FINISH_UPDATE), response, key_id)

        await self._tx(finish)
        return {"status": 201, "body": response}

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


class AsyncpgInflight:
    """``async_inflight.py``'s two-phase charge by hand on an asyncpg pool: claim the key,
    call the provider outside any transaction, store the charge and the answer; two
    SERIALIZABLE transactions, each retried on 40001."""

    def __init__(self, url: str, pool: int, post: Callable[[str], Awaitable[str]]) -> None:
        self.flow = AsyncpgByHand(url, pool)
        self.post = post

    async def open(self) -> None:
        await self.flow.open()

    async def run(self, key: str) -> dict[str, Any]:
        async def claim(conn: asyncpg.Connection) -> Any:
            row = await conn.fetchrow(_asyncpg(CLAIM_SELECT), 1, key)
            if row is not None:
                await conn.execute(_asyncpg(CLAIM_UPDATE), row[0])
                return row
            return await conn.fetchrow(_asyncpg(CLAIM_INSERT), key, "{}")

        key_id, point, _, code, body = await self.flow._tx(claim)
        if point == "finished":
            return {"status": code, "body": body}
        response = json.dumps({"charge": await self.post(f"asyncpg-{key_id}")})

        async def finish(conn: asyncpg.Connection) -> None:
            await conn.execute(_asyncpg(FINISH_UPDATE), response, key_id)

        await self.flow._tx(finish)
        return {"status": 201, "body": response}

    async def close(self) -> None:
        await self.flow.close()


class RecoveryPoint:
    """``rp.AsyncEngine`` on SQLAlchemy's async pool of psycopg connections."""

    def __init__(self, url: str, pool: int) -> None:
        self.size = pool
        self.db = sa_async.create_async_engine(
            normalize_url(url).set(drivername="postgresql+psycopg_async"),
            pool_size=pool,
            max_overflow=0,
            pool_use_lifo=True,  # as docs/how-to/production.md says, and asyncpg's pool does
        )
        self.engine = rp.AsyncEngine(self.db)
        self.op = async_ride_operation()
        self.engine.register(self.op)

    async def open(self) -> None:
        # Every connection of the pool opened before the window, as the others' are.
        held = [await self.db.connect() for _ in range(self.size)]
        for conn in held:
            await conn.close()

    async def run(self, key: str) -> rp.Outcome:
        return await self.engine.run(self.op, key=key, params=PARAMS, scope="1")

    async def close(self) -> None:
        await self.engine.dispose()
        await self.db.dispose()


class SyncEngine:
    """``rp.Engine`` in client threads: its CPU per request, beside the async sides'."""

    def __init__(self, url: str, pool: int) -> None:
        self.size = pool
        self.db = create_engine(url, pool_size=pool, max_overflow=0)
        self.engine = rp.Engine(self.db)
        self.op = ride_operation("bench_create_ride_sync")
        self.engine.register(self.op)

    def open(self) -> None:
        held = [self.db.raw_connection() for _ in range(self.size)]
        for pooled in held:
            pooled.close()

    def run(self, key: str) -> rp.Outcome:
        return self.engine.run(self.op, key=key, params=PARAMS, scope="1")

    def close(self) -> None:
        self.engine.dispose()
        self.db.dispose()


ASYNC_SIDES: dict[str, Any] = {
    "recoverypoint": RecoveryPoint,
    "psycopg": PsycopgByHand,
    "asyncpg": AsyncpgByHand,
}


def summary(
    requests: int, errors: int, seconds: float, cpu: float, server: float
) -> dict[str, float]:
    return {
        "requests": requests,
        "errors": errors,
        "seconds": seconds,
        "cpu": cpu,
        "server": server,
    }


async def window_tasks(
    clients: int, seconds: float, one: Callable[[str], Awaitable[Any]]
) -> dict[str, float]:
    """``clients`` tasks sending requests back to back for ``seconds``, after their
    warm-up; the requests done, failed, the wall time and this process's CPU."""
    done, errors, ready = 0, 0, 0
    first_error = ""
    go, stop = asyncio.Event(), asyncio.Event()

    async def client() -> None:
        nonlocal done, errors, ready, first_error
        for _ in range(WARMUP):
            # A failure here (the server's RWConflictPool full at 128 tasks) must not keep
            # the window from opening.
            with contextlib.suppress(Exception):
                await one(uuid.uuid4().hex)
        ready += 1
        if ready == clients:
            go.set()
        await go.wait()
        while not stop.is_set():
            try:
                await one(uuid.uuid4().hex)
                done += 1
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await go.wait()
    cpu, server, began = time.process_time(), every_postgres_cpu(), time.perf_counter()
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    figures = summary(
        done,
        errors,
        time.perf_counter() - began,
        time.process_time() - cpu,
        every_postgres_cpu() - server,
    )
    if first_error:
        print(f"  {errors} errors, the first: {first_error}")
    return figures


def window_threads(clients: int, seconds: float, one: Callable[[str], Any]) -> dict[str, float]:
    """The same with ``clients`` threads."""
    counts = [[0, 0] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(mine: list[int]) -> None:
        for _ in range(WARMUP):
            with contextlib.suppress(Exception):
                one(uuid.uuid4().hex)
        start.wait()
        while not stop.is_set():
            try:
                one(uuid.uuid4().hex)
                mine[0] += 1
            except Exception:
                mine[1] += 1

    threads = [threading.Thread(target=client, args=(mine,)) for mine in counts]
    for thread in threads:
        thread.start()
    start.wait()
    cpu, server, began = time.process_time(), every_postgres_cpu(), time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    server = every_postgres_cpu() - server
    return summary(sum(c[0] for c in counts), sum(c[1] for c in counts), elapsed, cpu, server)


async def async_window(side: str, url: str, pool: int, clients: int, seconds: float) -> Any:
    system = ASYNC_SIDES[side](url, pool)
    await system.open()
    try:
        return await window_tasks(clients, seconds, system.run)
    finally:
        await system.close()


def sync_window(url: str, pool: int, clients: int, seconds: float) -> Any:
    system = SyncEngine(url, pool)
    system.open()
    try:
        return window_threads(clients, seconds, system.run)
    finally:
        system.close()


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Every run's figures: ``results[loop][clients][side]`` is a list, one per run, of the
    run's rounds summed."""
    results: dict[str, Any] = {}
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    turn = 0
    for run in range(args.runs):
        for loop in loops:
            for clients in args.clients:
                summed: dict[str, dict[str, float]] = {}
                for round_ in range(args.rounds):
                    shift = turn % len(args.sides)
                    order = args.sides[shift:] + args.sides[:shift]
                    turn += 1
                    for side in order:
                        if side == "sync" and loop != loops[0]:
                            continue  # threads: the loop makes no difference to it
                        print(f"run {run + 1}, {loop}, {clients} tasks, round {round_ + 1}: {side}")
                        if side == "sync":
                            figures = sync_window(url, args.pool, clients, args.seconds)
                        else:
                            with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
                                figures = runner.run(
                                    async_window(side, url, args.pool, clients, args.seconds)
                                )
                        total = summed.setdefault(side, dict.fromkeys(figures, 0.0))
                        for name, value in figures.items():
                            total[name] += value
                for side, total in summed.items():
                    results.setdefault(loop, {}).setdefault(str(clients), {}).setdefault(
                        side, []
                    ).append(
                        {
                            **total,
                            "rps": total["requests"] / total["seconds"],
                            "cpu_ms": 1000 * total["cpu"] / max(total["requests"], 1),
                            "server_ms": 1000 * total["server"] / max(total["requests"], 1),
                        }
                    )
    return results


def _spread(values: list[float], digits: int = 2) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f} to {max(values):.{digits}f})"
    )


def report(results: dict[str, Any], args: argparse.Namespace, minutes: float) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        "# AsyncEngine against the flow by hand on psycopg async and on asyncpg",
        "",
        f"Written by `benchmarks/async_flow.py` in {minutes:.1f} min, commit `{commit}`, on "
        f"{platform.machine()}, {multiprocessing.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, asyncpg {asyncpg.__version__}, psycopg "
        f"{psycopg.__version__} ({psycopg.pq.__impl__}). {args.runs} runs of {args.rounds} "
        f"interleaved rounds of {args.seconds:g} s windows, pools of {args.pool} "
        "connections. Median (min to max) of the runs; ratios within each run. "
        "Reported, never asserted.",
        "",
    ]
    for loop, by_clients in results.items():
        lines += [
            f"## Event loop: {loop}",
            "",
            "| tasks in flight | AsyncEngine / psycopg by hand | AsyncEngine / asyncpg by hand "
            "| req/s: AsyncEngine · psycopg · asyncpg · sync Engine "
            "| client CPU ms/req: AsyncEngine · psycopg · asyncpg · sync Engine "
            "| server CPU ms/req: AsyncEngine · psycopg · asyncpg · sync Engine "
            "| errors: AsyncEngine · psycopg · asyncpg · sync Engine |",
            "|---|---|---|---|---|---|---|",
        ]
        for clients, sides in by_clients.items():
            rp_runs = sides.get("recoverypoint", [])

            def ratio(other: str, rp_runs: list[Any] = rp_runs, sides: Any = sides) -> str:
                if not rp_runs or other not in sides:
                    return "—"
                return _spread(
                    [a["rps"] / b["rps"] for a, b in zip(rp_runs, sides[other], strict=True)]
                )

            names = ("recoverypoint", "psycopg", "asyncpg", "sync")
            rps = " · ".join(
                _spread([r["rps"] for r in sides[n]], 0) if n in sides else "—" for n in names
            )
            cpu = " · ".join(
                _spread([r["cpu_ms"] for r in sides[n]], 3) if n in sides else "—" for n in names
            )
            server = " · ".join(
                _spread([r["server_ms"] for r in sides[n]], 2) if n in sides else "—" for n in names
            )
            errors = " · ".join(
                str(sum(int(r["errors"]) for r in sides[n])) if n in sides else "—" for n in names
            )
            lines.append(
                f"| {clients} | {ratio('psycopg')} | {ratio('asyncpg')} | {rps} | {cpu} "
                f"| {server} | {errors} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    with temporary_database(args.database_url) as url:
        migrate.upgrade(url)
        db = create_engine(url)
        with db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        db.dispose()
        plain = (
            normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        return measure(args, plain)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pool", type=int, default=24)
    parser.add_argument(
        "--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128]
    )
    parser.add_argument(
        "--sides",
        type=lambda s: s.split(","),
        default=["recoverypoint", "psycopg", "asyncpg", "sync"],
        help="a subset of recoverypoint,psycopg,asyncpg,sync",
    )
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="asyncio")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    began = time.monotonic()
    results = main(args)
    text = report(results, args, (time.monotonic() - began) / 60)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "async_flow.md").write_text(text)
    (args.results / "async_flow.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    cli()
