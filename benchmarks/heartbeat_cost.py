"""What the heartbeat costs a foreign step that ends before its first renewal is due: the
client CPU of ``hold`` and ``drop`` alone, on rp.Engine's heartbeat and rp.AsyncEngine's.
No renewal falls due (a 90 s lock timeout), so nothing touches a database.

    .venv/bin/python benchmarks/heartbeat_cost.py [--steps 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from recoverypoint.engine import heartbeat
from recoverypoint.engine._decide import KeyRef

KEY = KeyRef(1, "", uuid.uuid4(), "(0,1)", 0, "recoverypoint_0")


def sync_cost(steps: int) -> float:
    beat = heartbeat.Heartbeat(None)  # type: ignore[arg-type]  # never renews here
    began = time.process_time()
    for _ in range(steps):
        beat.drop(beat.hold(KEY, 90.0))
    return (time.process_time() - began) / steps


async def async_cost(steps: int) -> float:
    beat = heartbeat.AsyncHeartbeat(None)  # type: ignore[arg-type]  # never renews here
    began = time.process_time()
    for _ in range(steps):
        await beat.drop(beat.hold(KEY, 90.0))
    return (time.process_time() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    args = parser.parse_args()
    print(f"rp.Engine:      {sync_cost(args.steps) * 1e6:.2f} µs of client CPU per step")
    print(
        f"rp.AsyncEngine: {asyncio.run(async_cost(args.steps)) * 1e6:.2f} µs of client CPU per step"
    )


if __name__ == "__main__":
    main()
