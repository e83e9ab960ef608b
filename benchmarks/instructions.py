"""Client instructions per fresh-key request, counted by valgrind's callgrind.

    python benchmarks/instructions.py --database-url URL [--requests 300] [--async] [--replay]
        [--syscalls]

Seconds and CPU time drift on a shared machine; the instructions a process executes do
not. For each flow this runs a child process under ``valgrind --tool=callgrind`` twice, once
with the warm-up alone and once with ``--requests`` more fresh-key requests after it, and
reports the difference per request: the client's own cost of a request, in user space
(the kernel's side of each round trip and the server's work are not counted; the
round trips are counted by tests/test_round_trips.py). Needs valgrind (Debian's package).
The flows are the hand-written reference, the engine and the work alone
(``flows.WorkOnly``): the last is the floor under both, and what each spends beyond it is
what its key costs the client.

``--async`` counts the async sides of ``async_flow.py`` instead, one task at a time, on
asyncio's loop and on uvloop: ``rp.AsyncEngine`` and the flow by hand on asyncpg.

``--replay`` counts replays of one finished key instead: ``Engine.run`` of the flow's
operation (with ``--async``, ``rp.AsyncEngine.run`` on each loop) and a call of
``idempotent_cost.py``'s function under ``@rp.idempotent`` on the same engine, beside the
floor a replay is judged against, one prepared ``SELECT`` of the stored answer by psycopg
(``flows.PreparedSelect``).

``--syscalls`` counts the system calls each child makes instead, with ``strace -f -c``
(Debian's package): the kernel's side, which the instructions leave out, by call.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))

from async_flow import ASYNC_SIDES, loop_factory
from flows import (
    SCHEMA,
    PreparedSelect,
    RecoveryPointFlow,
    Reference,
    WorkOnly,
    ride_operation,
)
from idempotent_cost import charge_order, charge_order_async

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.migrate import upgrade

WARM_UP = 60  # psycopg prepares a statement on its 5th run; the pool fills; caches warm
FLOWS = ("reference", "recoverypoint", "work-only")
REPLAYS = ("prepared-select", "recoverypoint-replay", "idempotent-replay")
REPLAYED = "replayed-key"  # finished by every replay child before it counts anything
# An async flow is named side@loop: an async_flow.py side, or a replay, on one loop.
LOOPS = ("asyncio", "uvloop")
ASYNC_FLOWS = tuple(f"{side}@{loop}" for loop in LOOPS for side in ("asyncpg", "recoverypoint"))
ASYNC_REPLAYS = tuple(f"{side}@{loop}" for loop in LOOPS for side in REPLAYS)


def child(url: str, flow_name: str, requests: int) -> None:
    """Run the warm-up and ``requests`` fresh keys of one flow (under callgrind)."""
    if "@" in flow_name:
        side, loop = flow_name.split("@")
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(async_child(url, side, requests))
        return
    if flow_name in REPLAYS:
        replay_child(url, flow_name, requests)
        return
    flow = sync_flow(url, flow_name)
    for _ in range(WARM_UP + requests):
        flow.run(uuid.uuid4().hex)
    flow.close()


def beyond_the_work(per_request: dict[str, float]) -> str:
    """What the engine and the reference each spend on their key beyond the work alone
    (``work-only``), and the first against the second: issue 41's item 1 asks the engine's
    rate at 1.5 times the reference's, which takes that ratio near 0.4."""
    floor = per_request["work-only"]
    spent = {name: per_request[name] - floor for name in ("recoverypoint", "reference")}
    return (
        f"  beyond the work alone: recoverypoint {spent['recoverypoint'] / 1000:,.0f}k, "
        f"reference {spent['reference'] / 1000:,.0f}k "
        f"({spent['recoverypoint'] / spent['reference']:.2f})"
    )


def sync_flow(url: str, flow_name: str) -> Any:
    """The sync flow ``flow_name`` of ``FLOWS``, on one connection of its own."""
    if flow_name == "reference":
        return Reference(url)
    if flow_name == "work-only":
        return WorkOnly(url)
    engine = rp.Engine(url)
    operation = ride_operation()
    engine.register(operation)
    return RecoveryPointFlow(engine, operation)


def replay_child(url: str, flow_name: str, requests: int) -> None:
    """Finish one key, then replay it (or read its answer by the floor's SELECT)."""
    flow = sync_flow(url, "recoverypoint")
    flow.run(REPLAYED)  # the first child finishes it; every later one replays it
    if flow_name == "prepared-select":
        floor = PreparedSelect(url, flow.scope, flow.op.name)
        for _ in range(WARM_UP + requests):
            floor.run(REPLAYED)
        floor.close()
        return
    if flow_name == "idempotent-replay":
        engine: rp.Engine = flow.engine
        decorated = rp.idempotent(engine, key="order_id", name="counted")(charge_order)
        for _ in range(1 + WARM_UP + requests):  # the first child's first call finishes it
            decorated(REPLAYED, 1250)
        return
    for _ in range(WARM_UP + requests):
        flow.run(REPLAYED)


async def async_child(url: str, side: str, requests: int) -> None:
    """Fresh keys of an async side, or (a side of ``REPLAYS``) replays on the AsyncEngine."""
    system = ASYNC_SIDES["recoverypoint" if side in REPLAYS else side](url, 1)
    await system.open()
    try:
        if side not in REPLAYS:
            for _ in range(WARM_UP + requests):
                await system.run(uuid.uuid4().hex)
            return
        await system.run(REPLAYED)  # the first child finishes it; every later one replays it
        if side == "recoverypoint-replay":
            for _ in range(WARM_UP + requests):
                await system.run(REPLAYED)
            return
        if side == "idempotent-replay":
            async_engine: rp.AsyncEngine = system.engine
            decorated_async = rp.idempotent(async_engine, key="order_id", name="counted")(
                charge_order_async
            )
            for _ in range(1 + WARM_UP + requests):  # the first child's first call finishes it
                await decorated_async(REPLAYED, 1250)
            return
        floor = await psycopg.AsyncConnection.connect(url, autocommit=True)
        found = (REPLAYED, "1", system.op.name)
        for _ in range(WARM_UP + requests):
            cursor = await floor.execute(PreparedSelect.STATEMENT, found, prepare=True)
            if await cursor.fetchone() is None:
                raise RuntimeError("no stored answer to read")
        await floor.close()
    finally:
        await system.close()


def child_command(url: str, flow_name: str, requests: int) -> list[str]:
    """The command of a child that runs the warm-up and ``requests`` of ``flow_name``."""
    return [
        sys.executable, __file__, "--child", flow_name, "--database-url", url,
        "--requests", str(requests),
    ]  # fmt: skip


def collected(url: str, flow_name: str, requests: int, syscalls: bool) -> Counter[str]:
    """What a child running ``requests`` after the warm-up made: its instructions, counted
    by callgrind, or its system calls by name (and their ``total``), counted by strace."""
    child = child_command(url, flow_name, requests)
    if syscalls:
        with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
            subprocess.run(["strace", "-f", "-c", "-o", out.name, *child], check=True)
            return Counter({name: int(calls) for calls, name in _STRACE_ROW.findall(out.read())})
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *child]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no total:\n{done.stderr[-2000:]}")
    return Counter(total=int(match.group(1)))


# A row of strace -c's table: % time, seconds, usecs/call, calls, errors (may be blank), name.
_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", re.M)


def require(tool: str) -> None:
    if shutil.which(tool) is None:
        sys.exit(f"{tool} is not installed: apt-get install -y {tool}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--syscalls", action="store_true", help="count system calls (strace)")
    every = FLOWS + ASYNC_FLOWS + REPLAYS + ASYNC_REPLAYS
    parser.add_argument("--child", choices=every, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.database_url, args.child, args.requests)
        return
    require("strace" if args.syscalls else "valgrind")

    admin = normalize_url(args.database_url).set(drivername="postgresql")
    name = f"rp_instr_{secrets.token_hex(4)}"
    admin_url = admin.render_as_string(False)
    url = admin.set(database=name).render_as_string(False)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        what = "replay of a finished key" if args.replay else "fresh-key request"
        counted = "system calls" if args.syscalls else "client instructions"
        print(f"{counted} per {what} ({args.requests} requests each)")
        if args.use_async:
            flows = ASYNC_REPLAYS if args.replay else ASYNC_FLOWS
        else:
            flows = REPLAYS if args.replay else FLOWS
        per_request = {}
        for flow_name in flows:
            if args.replay:
                # The first child of a replay finishes the key it replays: one uncounted, so
                # that both counted children start with a replay.
                subprocess.run(child_command(url, flow_name, 0), check=True)
            warm_up = collected(url, flow_name, 0, args.syscalls)
            extra = collected(url, flow_name, args.requests, args.syscalls)
            extra.subtract(warm_up)
            per_request[flow_name] = extra["total"] / args.requests
            if args.syscalls:  # the three calls it makes most of, per request
                most = ", ".join(
                    f"{name} {calls / args.requests:.1f}"
                    for name, calls in (extra - Counter(total=extra["total"])).most_common(3)
                )
                print(f"  {flow_name:31} {per_request[flow_name]:8.1f}  ({most})", flush=True)
            else:
                print(f"  {flow_name:31} {per_request[flow_name] / 1000:8,.0f}k", flush=True)
        # Each side against the one it is judged beside, on the same loop.
        pairs = {
            "recoverypoint-replay": "prepared-select",
            "idempotent-replay": "prepared-select",
            "recoverypoint": "asyncpg" if args.use_async else "reference",
        }
        for flow_name in flows:
            side, _, loop = flow_name.partition("@")
            if side in pairs:
                beside = pairs[side] + ("@" + loop if loop else "")
                ratio = per_request[flow_name] / per_request[beside]
                print(f"  {flow_name} / {beside}: {ratio:.2f}")
        if "work-only" in per_request:
            print(beyond_the_work(per_request))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
