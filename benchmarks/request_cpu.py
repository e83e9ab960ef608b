"""Client CPU per request of an operation with a foreign step (atomic phase, foreign step,
atomic phase answering 201), one client, fresh keys, on rp.Engine and rp.AsyncEngine: what
a short step's heartbeat adds to a whole request. Runs against whichever recoverypoint is
imported, so that two source trees alternate (benchmarks/README.md):

    .venv/bin/python benchmarks/request_cpu.py --database-url URL [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import recoverypoint as rp
from recoverypoint.migrate import upgrade
from recoverypoint.testing import temporary_database


def operation(kind: str) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("bench_step")
    if kind == "sync":
        op.atomic_phase("begun")(lambda tx, params: None)
        op.foreign_step("sent")(lambda step, params: {"id": step.downstream_key()})
        op.atomic_phase("done")(lambda tx, params: rp.Response(201, dict(tx.state)))
    else:

        async def begin(tx: Any, params: Any) -> None:
            return None

        async def send(step: rp.StepContext, params: Any) -> dict[str, str]:
            return {"id": step.downstream_key()}

        async def done(tx: Any, params: Any) -> rp.Response:
            return rp.Response(201, dict(tx.state))

        op.atomic_phase("begun")(begin)
        op.foreign_step("sent")(send)
        op.atomic_phase("done")(done)
    return op


def sync_cpu(url: str, requests: int) -> float:
    engine = rp.Engine(url)
    op = operation("sync")
    engine.register(op)
    scope = uuid.uuid4().hex

    def run(n: int) -> None:
        for i in range(n):
            engine.run(op, key=f"{scope}-{i}-{n}", params={}, scope=scope)

    run(requests // 10)  # warm: pool, prepared statements
    began = time.process_time()
    run(requests)
    cpu = (time.process_time() - began) / requests
    engine.dispose()
    return cpu


async def async_cpu(url: str, requests: int) -> float:
    engine = rp.AsyncEngine(url)
    op = operation("async")
    engine.register(op)
    scope = uuid.uuid4().hex

    async def run(n: int) -> None:
        for i in range(n):
            await engine.run(op, key=f"{scope}-{i}-{n}", params={}, scope=scope)

    await run(requests // 10)
    began = time.process_time()
    await run(requests)
    cpu = (time.process_time() - began) / requests
    await engine.dispose()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="a server: a database is made")
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with temporary_database(args.database_url, prefix="rp_bench_cpu") as url:
        upgrade(url)
        sync = sync_cpu(url, args.requests)
        async_ = asyncio.run(async_cpu(url, args.requests))
    print(f"{sync * 1e3:.3f} {async_ * 1e3:.3f}  ms of client CPU per request (sync, async)")


if __name__ == "__main__":
    main()
