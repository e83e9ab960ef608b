"""The async path against today's thread offload, side by side in one run.

1. **In flight**: 1,000 requests at once, each a fresh key whose foreign step calls a fake
   payment provider on loopback (its own process, uvicorn) that answers after 200 ms:
   (a) ``rp.AsyncEngine`` with an async step on ``httpx.AsyncClient`` (20 of them, 50
   connections each, see ``inflight_operations``), every request a task of one event
   loop; (b) ``rp.Engine`` with a sync step on ``httpx.Client``, each request
   sent to a worker thread through ``anyio.to_thread.run_sync`` with anyio's default limit
   of 40 threads (what Starlette's ``run_in_threadpool`` uses); (c) the same by hand on
   an asyncpg pool (``async_flow.AsyncpgInflight``: claim, the call outside any
   transaction, the answer stored), tasks of the same loop. Each gets 40 pooled
   connections. Reported: req/s, p50, p99.
2. **Fresh-key flow**: Rocket Rides (``flows.py``: create a ride and its audit record,
   "charge" in-process, record it, stage a job, answer) at 1, 8 and 32 clients: sync
   ``rp.Engine`` in client threads vs ``rp.AsyncEngine`` in client tasks, with this
   process's CPU per request beside the throughput.

Nothing here asserts a speed. Writes ``results/async.md``::

    .venv/bin/python benchmarks/async_inflight.py \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
from flows import PARAMS, SCHEMA, charge, ride_operation
from sqlalchemy.ext import asyncio as sa_async

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.testing import temporary_database

PROVIDER_DELAY = 0.2
POOL = 40  # connections for either path; the thread offload's threads are 40 too
ASYNC_CLIENTS = 20

# -- the fake provider, in a process of its own --------------------------------------------


def _provider(listening: socket.socket) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def charges(request: Request) -> JSONResponse:
        await asyncio.sleep(PROVIDER_DELAY)
        return JSONResponse({"id": "ch_" + request.headers["idempotency-key"][:20]})

    app = Starlette(routes=[Route("/charges", charges, methods=["POST"])])
    config = uvicorn.Config(app, log_level="warning", backlog=4096)
    uvicorn.Server(config).run(sockets=[listening])


def start_provider() -> tuple[BaseProcess, str]:
    """The provider's process, handed a socket already listening: a port probed free and
    bound again by the child could be taken in between (by an outgoing connection's port)."""
    with socket.create_server(("127.0.0.1", 0), backlog=4096) as listening:
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        process = multiprocessing.get_context("spawn").Process(target=_provider, args=(listening,))
        process.start()
        # Connections queue on the socket from now on: an answer says the provider serves.
        ready = httpx.post(f"{url}/charges", headers={"Idempotency-Key": "ready"}, timeout=30)
        ready.raise_for_status()
    return process, url


# -- the operations ------------------------------------------------------------------------


def inflight_operations(
    url: str,
) -> tuple[rp.Operation[Any], rp.Operation[Any], list[Any], Callable[[str], Awaitable[str]]]:
    """The same two-phase charge, sync and async; the clients to close afterwards; and the
    provider's call alone, for the flow by hand on asyncpg."""
    sync_client = httpx.Client(base_url=url, limits=httpx.Limits(max_connections=POOL))
    # Several async clients of 50 connections: one httpx.AsyncClient holding 1,000 scans
    # its whole pool on every request and release (httpcore), which took 14 to 20 ms of
    # CPU per request here, more than everything else together.
    async_clients = [
        httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=50))
        for _ in range(ASYNC_CLIENTS)
    ]

    async def post(downstream_key: str) -> str:
        """The provider's call for the flow by hand on asyncpg (``async_flow``)."""
        client = async_clients[hash(downstream_key) % ASYNC_CLIENTS]
        response = await client.post(
            "/charges", headers={"Idempotency-Key": downstream_key}, timeout=60
        )
        return str(response.json()["id"])

    sync_op: rp.Operation[Any] = rp.Operation("inflight_sync")
    async_op: rp.Operation[Any] = rp.Operation("inflight_async")

    @sync_op.foreign_step("charged")
    def sync_charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        response = sync_client.post("/charges", headers={"Idempotency-Key": step.downstream_key()})
        return {"charge": response.json()["id"]}

    @async_op.foreign_step("charged")
    async def async_charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        client = async_clients[hash(step.key_id) % ASYNC_CLIENTS]
        response = await client.post(
            "/charges", headers={"Idempotency-Key": step.downstream_key()}, timeout=60
        )
        return {"charge": response.json()["id"]}

    @sync_op.atomic_phase("finished")
    def sync_finish(tx: Any, params: Any) -> rp.Response:
        return rp.Response(201, {"charge": tx.state["charge"]})

    @async_op.atomic_phase("finished")
    async def async_finish(tx: Any, params: Any) -> rp.Response:
        return sync_finish(tx, params)

    return sync_op, async_op, [sync_client, *async_clients], post


def async_ride_operation() -> rp.Operation[Any]:
    """``flows.ride_operation`` with async phases: the same statements, awaited."""
    op: rp.Operation[Any] = rp.Operation("bench_create_ride_async")

    @op.atomic_phase("ride_created")
    async def create_ride(tx: Any, params: dict[str, Any]) -> None:
        cursor = await tx.execute(
            "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) "
            "VALUES (%(k)s, %(lat)s, %(lon)s) RETURNING id",
            {"k": str(tx.key_id), "lat": params["origin_lat"], "lon": params["origin_lon"]},
        )
        ride_id = (await cursor.fetchone())[0]
        await tx.execute(
            "INSERT INTO bench_audit_records (action, data, resource_id) "
            "VALUES ('ride.created', CAST(%(d)s AS jsonb), %(r)s)",
            {"d": json.dumps(params), "r": ride_id},
        )
        tx.state["ride_id"] = ride_id

    @op.foreign_step("charge_created")
    async def charge_step(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"charge_id": charge(step.downstream_key())}

    @op.atomic_phase("finished")
    async def finish(tx: Any, params: dict[str, Any]) -> rp.Response:
        await tx.execute(
            "UPDATE bench_rides SET charge_id = %(c)s WHERE id = %(i)s",
            {"c": tx.state["charge_id"], "i": tx.state["ride_id"]},
        )
        tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
        return rp.Response(
            201, {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
        )

    return op


# -- measuring -----------------------------------------------------------------------------


def summary(latencies: list[float], seconds: float, cpu: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "seconds": seconds,
        "rps": len(ordered) / seconds,
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "cpu_ms_per_request": 1000 * cpu / len(ordered),
    }


async def burst(requests: int, one: Callable[[str], Awaitable[Any]]) -> dict[str, float]:
    """``requests`` calls of ``one`` started at once, each with a fresh key; a call that
    fails (the server's RWConflictPool full, say) is counted, not timed."""
    latencies: list[float] = []
    errors: list[str] = []

    async def timed() -> None:
        began = time.perf_counter()
        try:
            await one(uuid.uuid4().hex)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        latencies.append(time.perf_counter() - began)

    cpu, began = time.process_time(), time.perf_counter()
    await asyncio.gather(*(timed() for _ in range(requests)))
    figures = summary(latencies, time.perf_counter() - began, time.process_time() - cpu)
    figures["errors"] = len(errors)
    if errors:
        print(f"  {len(errors)} failed, the first: {errors[0]}")
    return figures


def window_threads(clients: int, seconds: float, one: Callable[[str], Any]) -> dict[str, float]:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(mine: list[float]) -> None:
        for _ in range(6):  # warm-up: psycopg prepares on the 5th execution
            one(uuid.uuid4().hex)
        start.wait()
        while not stop.is_set():
            began = time.perf_counter()
            one(uuid.uuid4().hex)
            mine.append(time.perf_counter() - began)

    threads = [threading.Thread(target=client, args=(mine,)) for mine in latencies]
    for thread in threads:
        thread.start()
    start.wait()
    cpu, began = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    return summary([x for mine in latencies for x in mine], elapsed, cpu)


async def window_tasks(
    clients: int, seconds: float, one: Callable[[str], Awaitable[Any]]
) -> dict[str, float]:
    latencies: list[float] = []
    ready = 0
    go = asyncio.Event()
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal ready
        for _ in range(6):
            await one(uuid.uuid4().hex)
        ready += 1
        if ready == clients:
            go.set()
        await go.wait()
        while not stop.is_set():
            began = time.perf_counter()
            await one(uuid.uuid4().hex)
            latencies.append(time.perf_counter() - began)

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await go.wait()
    cpu, began = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return summary(latencies, time.perf_counter() - began, time.process_time() - cpu)


# -- the run -------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"inflight": {}, "flow": {}}
    with temporary_database(args.database_url) as url:
        migrate.upgrade(url)
        db = create_engine(url, pool_size=POOL, max_overflow=0)
        with db.begin() as conn:
            conn.exec_driver_sql(SCHEMA)
        async_db = sa_async.create_async_engine(
            normalize_url(url).set(drivername="postgresql+psycopg_async"),
            pool_size=POOL,
            max_overflow=0,
        )
        engine, async_engine = rp.Engine(db), rp.AsyncEngine(async_db)
        provider, provider_url = start_provider()
        sync_op, async_op, clients, post = inflight_operations(provider_url)
        rides, async_rides = ride_operation(), async_ride_operation()
        engine.register(sync_op, rides)
        async_engine.register(async_op, async_rides)
        # Imported here: async_flow imports this module's operations.
        from async_flow import AsyncpgInflight

        plain = normalize_url(url).set(drivername="postgresql")
        by_hand = AsyncpgInflight(plain.render_as_string(hide_password=False), POOL, post)

        # The three pools of 40 would not fit in the server's max_connections (100, shared)
        # at once: each path's pool is filled before its burst and closed after it.
        async def fill(path: str) -> None:
            if path == "async":
                held = [await async_db.connect() for _ in range(POOL)]
                for conn in held:
                    await conn.close()
            elif path == "threads":
                raw = await asyncio.to_thread(lambda: [db.raw_connection() for _ in range(POOL)])
                for pooled in raw:
                    pooled.close()
            else:
                await by_hand.open()

        async def empty(path: str) -> None:
            if path == "async":
                await async_db.dispose()
            elif path == "threads":
                db.dispose()
            else:
                await by_hand.close()

        paths: dict[str, Callable[[str], Awaitable[Any]]] = {
            "async": lambda key: async_engine.run(async_op, key=key, params=None),
            "asyncpg": by_hand.run,
            "threads": lambda key: anyio.to_thread.run_sync(
                lambda: engine.run(sync_op, key=key, params=None)
            ),
        }
        try:
            # Round 0 warms up, untimed: pooled connections to PostgreSQL and to the
            # provider open, statements prepared, as in a server that has been running.
            for round_ in range(args.rounds + 1):  # interleaved, so drift hits both alike
                for path, one in paths.items():
                    print(f"round {round_}: {args.requests} in flight, {path}", flush=True)
                    await fill(path)
                    try:
                        result = await burst(args.requests, one)
                    finally:
                        await empty(path)
                    if round_:
                        results["inflight"].setdefault(path, []).append(result)
            for clients_n in args.clients:
                print(f"fresh-key flow at {clients_n} clients", flush=True)
                results["flow"][f"async/{clients_n}"] = await window_tasks(
                    clients_n,
                    args.seconds,
                    lambda key: async_engine.run(async_rides, key=key, params=PARAMS, scope="1"),
                )
                results["flow"][f"sync/{clients_n}"] = await asyncio.to_thread(
                    window_threads,
                    clients_n,
                    args.seconds,
                    lambda key: engine.run(rides, key=key, params=PARAMS, scope="1"),
                )
        finally:
            provider.terminate()
            provider.join(30)
            clients[0].close()
            for client in clients[1:]:
                await client.aclose()
            await async_engine.dispose()
            await async_db.dispose()
            engine.dispose()
            db.dispose()
    return results


def report(results: dict[str, Any], args: argparse.Namespace, minutes: float) -> str:
    lines = [
        "# Async path vs thread offload",
        "",
        f"Written by `benchmarks/async_inflight.py` in {minutes:.1f} min on "
        f"{platform.machine()}, {multiprocessing.cpu_count()} CPUs, Python "
        f"{platform.python_version()}. Reported, never asserted.",
        "",
        f"## {args.requests} requests in flight, the foreign call waits "
        f"{int(PROVIDER_DELAY * 1000)} ms",
        "",
        f"A fresh key each; {POOL} pooled connections either way; the thread offload has "
        "anyio's default 40 threads (Starlette's `run_in_threadpool`). "
        f"{args.rounds} rounds after an untimed warm-up round, interleaved; each row is one "
        "round. The async step spreads its calls over 20 `httpx.AsyncClient`s of 50 "
        "connections: one client holding 1,000 connections spent 14 to 20 ms of CPU per "
        "request scanning its pool (httpcore), 41 to 59 req/s in all.",
        "",
        "| path | round | req/s | p50 ms | p99 ms | wall s | client CPU ms/req | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {
        "async": "AsyncEngine, tasks",
        "asyncpg": "by hand on asyncpg, tasks",
        "threads": "Engine, 40 threads",
    }
    for path, label in labels.items():
        for index, r in enumerate(results["inflight"][path], 1):
            lines.append(
                f"| {label} | {index} | {r['rps']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} "
                f"| {r['seconds']:.2f} | {r['cpu_ms_per_request']:.2f} | {r.get('errors', 0)} |"
            )
    lines += [
        "",
        f"## Fresh-key flow (Rocket Rides, in-process charge), {args.seconds:.0f} s windows",
        "",
        "Sync: `rp.Engine`, one client per thread. Async: `rp.AsyncEngine`, one client per "
        "task of one event loop. CPU is this process's (clients and library), per request.",
        "",
        "| clients | sync req/s | async req/s | async/sync | sync CPU ms/req | async CPU ms/req "
        "| sync p99 ms | async p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in args.clients:
        s, a = results["flow"][f"sync/{n}"], results["flow"][f"async/{n}"]
        lines.append(
            f"| {n} | {s['rps']:.0f} | {a['rps']:.0f} | {a['rps'] / s['rps']:.2f}x "
            f"| {s['cpu_ms_per_request']:.2f} | {a['cpu_ms_per_request']:.2f} "
            f"| {s['p99_ms']:.1f} | {a['p99_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    began = time.monotonic()
    results = asyncio.run(main(args))
    text = report(results, args, (time.monotonic() - began) / 60)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "async.md").write_text(text)
    print(text)


if __name__ == "__main__":
    cli()
