"""Where an async replay's client CPU goes, beside the floor it is judged against.

    python benchmarks/replay_parts.py --database-url URL [--loop both] [--rounds 3]

Issue 41 judges a replay against one prepared ``SELECT`` of the stored answer on a held
connection (``idempotent_cost.py``'s floor). ``rp.AsyncEngine.run`` on a finished key does
more than that statement: it validates and fingerprints the request, borrows a connection
from SQLAlchemy's pool and hands it back, and goes through the layers between ``run`` and
its one statement. This times each part on its own, in turns, as CPU per call of this
process (``time.process_time``), one caller:

* ``floor``: the prepared ``SELECT`` by primary key, psycopg, autocommit, held connection;
* ``replay``: ``AsyncEngine.run`` of a finished key (what a client's retry costs);
* ``claim transaction``: the replay's unit of work in its transaction
  (``AsyncEngine._transact`` of the claim), the params checked (validated and
  fingerprinted) before it, during its lookup (as ``run`` does), or once for all calls;
* ``lookup``: the borrow, the finished key's lookup (``store_async.finished_key``) and the
  hand-back;
* ``borrow``: the borrow and the hand-back alone;
* ``request checks``: the key's and the params' checks alone (``requested`` and
  ``claim_request``).

It calls the engine's private parts, so it follows them: a change there may need one here.
Reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.ext import asyncio as sa_async

sys.path.insert(0, str(Path(__file__).parent))

import facts as machine
from async_flow import loop_factory

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import normalize_url
from recoverypoint.engine import _pg_async, store_async
from recoverypoint.engine._decide import claim_request
from recoverypoint.engine.run_async import _Claim
from recoverypoint.testing import temporary_database

HERE = Path(__file__).resolve().parent
WARMUP = 500
KEY = "replayed-key"
PARAMS = {"order_id": KEY, "amount": 1250}


async def charge_order(order_id: str, amount: int) -> dict[str, Any]:
    return {"order_id": order_id, "amount": amount, "status": "charged"}


async def parts(url: str) -> tuple[dict[str, Callable[[], Awaitable[Any]]], Callable[[], Any]]:
    """Each part as a call of its own, and what closes them."""
    db = sa_async.create_async_engine(
        normalize_url(url).set(drivername="postgresql+psycopg_async"), pool_size=2
    )
    engine = rp.AsyncEngine(db)
    decorated = rp.idempotent(engine, key="order_id", name="replay_parts")(charge_order)
    await decorated(KEY, 1250)  # finished: every later run of the key replays it
    operation: rp.Operation[Any] = decorated.operation  # type: ignore[attr-defined]
    namespace = engine.namespace
    assert namespace is not None  # read by the first run
    plain = sa.make_url(url).set(drivername="postgresql").render_as_string(False)
    floor = await psycopg.AsyncConnection.connect(plain, autocommit=True)
    # Made by the first loop's parts, kept for the next.
    await floor.execute(
        "CREATE TABLE IF NOT EXISTS replay_floor (id bigint PRIMARY KEY, body jsonb NOT NULL)"
    )
    await floor.execute(
        'INSERT INTO replay_floor VALUES (1, \'{"order_id": "x", "amount": 1250}\') '
        "ON CONFLICT DO NOTHING"
    )
    retention = operation.honoured_for.total_seconds()

    def checked() -> Any:
        requested = engine.requested(operation, KEY, "", None)
        return claim_request(operation, requested, PARAMS, engine.max_params_bytes, namespace)

    request = checked()
    requested = engine.requested(operation, KEY, "", None)

    async def floor_select() -> None:
        cursor = await floor.execute(
            "SELECT body FROM replay_floor WHERE id = %s", (1,), prepare=True
        )
        await cursor.fetchone()

    async def replay() -> None:
        await engine.run(operation, key=KEY, params=PARAMS, scope="")

    async def claim_transaction_checked_before() -> None:
        claim = _Claim(operation, requested, checked, PARAMS, None)  # type: ignore[arg-type]
        claim.check()
        await engine._transact(engine._claim, claim)

    async def claim_transaction() -> None:
        claim = _Claim(operation, requested, checked, PARAMS, None)  # type: ignore[arg-type]
        await engine._transact(engine._claim, claim)

    async def claim_transaction_unchecked() -> None:
        claim = _Claim(operation, requested, lambda: request, PARAMS, None)  # type: ignore[arg-type]
        await engine._transact(engine._claim, claim)

    async def lookup() -> None:
        pooled, connection, switched = await _pg_async._borrow(db, autocommit=False)
        try:
            tx = _pg_async.AsyncTransaction(db, pooled, connection)
            await store_async.finished_key(tx, requested, retention, bound=False)
        finally:
            await _pg_async._give_back(db, pooled, connection, switched)

    async def borrow() -> None:
        pooled, connection, switched = await _pg_async._borrow(db, autocommit=False)
        await _pg_async._give_back(db, pooled, connection, switched)

    async def request_checks() -> None:
        checked()

    async def close() -> None:
        await floor.close()
        await engine.dispose()
        await db.dispose()

    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "floor": floor_select,
        "replay": replay,
        "claim transaction, request checked before it": claim_transaction_checked_before,
        "claim transaction, request checked during the lookup": claim_transaction,
        "claim transaction, request checked once for all": claim_transaction_unchecked,
        "lookup": lookup,
        "borrow": borrow,
        "request checks": request_checks,
    }
    return calls, close


async def measure(url: str, rounds: int, calls: int) -> dict[str, list[float]]:
    """µs of CPU per call of each part, one figure per round; parts in turns."""
    sides, close = await parts(url)
    try:
        for call in sides.values():
            for _ in range(WARMUP):
                await call()
        results: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for round_ in range(rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                call = sides[name]
                began = time.process_time()
                for _ in range(calls):
                    await call()
                results[name].append((time.process_time() - began) / calls * 1e6)
        return results
    finally:
        await close()


def report(
    results: dict[str, dict[str, list[float]]], facts: dict[str, Any], args: argparse.Namespace
) -> str:
    lines = [
        "# Where an async replay's client CPU goes",
        "",
        f"Written by `benchmarks/replay_parts.py`: one caller, {args.rounds} rounds of "
        f"{args.calls} calls per part, parts in turns; µs of this process's CPU per call, "
        "median (min to max) of the rounds. Reported, never asserted.",
        "",
        *machine.markdown(facts),
        "",
    ]
    for loop, parts_ in results.items():
        floor = statistics.median(parts_["floor"])
        lines += [
            f"## {loop}",
            "",
            "| part | CPU µs per call | / the floor's |",
            "|---|---|---|",
        ]
        for name, values in parts_.items():
            median = statistics.median(values)
            lines.append(
                f"| {name} | {median:.1f} ({min(values):.1f} to {max(values):.1f}) "
                f"| {median / floor:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    loops = ("asyncio", "uvloop") if args.loop == "both" else (args.loop,)
    results: dict[str, dict[str, list[float]]] = {}
    with temporary_database(args.database_url, prefix="rp_replay_parts") as made:
        migrate.upgrade(made)
        plain = sa.make_url(made).set(drivername="postgresql").render_as_string(False)
        facts = machine.collect(HERE.parent, plain, None)
        for loop in loops:
            with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
                results[loop] = runner.run(measure(made, args.rounds, args.calls))
            print(f"{loop}: done", flush=True)
        facts["loadavg_at_end"] = machine.loadavg()
    text = report(results, facts, args)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "replay_parts.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
