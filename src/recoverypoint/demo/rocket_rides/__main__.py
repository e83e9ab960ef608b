"""``python -m recoverypoint.demo.rocket_rides provider|api|simulate|migrate``; ``--help``
on each."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from recoverypoint.database import DATABASE_URL_ENV
from recoverypoint.exits import program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recoverypoint.demo.rocket_rides",
        description="Rocket Rides, the reference service of idempotency keys, on recoverypoint.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    migrate = commands.add_parser("migrate", help="create recoverypoint's and the example's tables")
    _database_url(migrate)
    migrate.set_defaults(handler=_migrate)

    provider = commands.add_parser("provider", help="run the fake payment provider")
    _database_url(provider)
    _listen(provider, 8001)
    provider.add_argument(
        "--fail-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="probability of a 500 before charging (default 0)",
    )
    provider.add_argument(
        "--fail-after-charge-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="probability that a new charge is stored, then answered with a "
        "500 or a dropped connection, alternately (default 0)",
    )
    provider.add_argument(
        "--latency-ms", type=int, default=0, metavar="MS", help="wait before answering (default 0)"
    )
    provider.add_argument("--seed", type=int, default=None, help="for repeatable faults")
    provider.set_defaults(handler=_provider)

    api = commands.add_parser("api", help="run the Rocket Rides API")
    _database_url(api)
    _listen(api, 8000)
    api.add_argument(
        "--provider-url",
        required=True,
        metavar="URL",
        help="the payment provider, e.g. http://127.0.0.1:8001",
    )
    api.add_argument(
        "--lock-timeout",
        type=float,
        default=90.0,
        metavar="SECONDS",
        help="how long a request holds its key before a retry may take it over (default 90); "
        "the completer must run with the same (ROCKET_RIDES_LOCK_TIMEOUT)",
    )
    api.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="run the operation on rp.AsyncEngine, its phases async def, on the event loop "
        "(the workers then take recoverypoint.demo.rocket_rides.workers:async_engine)",
    )
    api.set_defaults(handler=_api)

    simulate = commands.add_parser("simulate", help="book rides through the retrying client")
    simulate.add_argument(
        "--api-url", required=True, metavar="URL", help="the API, e.g. http://127.0.0.1:8000"
    )
    simulate.add_argument("--requests", type=int, default=20, metavar="N")
    simulate.add_argument("--concurrency", type=int, default=4, metavar="C")
    simulate.add_argument("--seed", type=int, default=None, help="for repeatable rides")
    simulate.set_defaults(handler=_simulate)

    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


def _database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        required=DATABASE_URL_ENV not in os.environ,
        help=f"postgresql://user:password@host:port/database (default: ${DATABASE_URL_ENV})",
    )


def _listen(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--fd",
        type=int,
        default=None,
        metavar="FD",
        help="serve on this inherited listening socket instead of --host/--port, as "
        "several processes (and restarts) can share one, and a port chosen by whoever "
        "started the process is never taken by another in between",
    )


def _serve(app: Any, args: argparse.Namespace) -> None:
    import socket

    import uvicorn

    if args.fd is None:
        uvicorn.run(app, host=args.host, port=args.port)
    else:
        uvicorn.Server(uvicorn.Config(app)).run(sockets=[socket.socket(fileno=args.fd)])


def _migrate(args: argparse.Namespace) -> int:
    from recoverypoint.database import create_engine

    from .schema import USERS, migrate

    db = create_engine(args.database_url)
    try:
        migrate(db)
    finally:
        db.dispose()
    print(f"Rocket Rides tables are ready; users: {', '.join(USERS)}")
    return 0


def _provider(args: argparse.Namespace) -> int:
    from recoverypoint.database import create_engine

    from .provider import Faults, create_app
    from .schema import require

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    db = create_engine(args.database_url)
    require(db, "provider_charges")
    faults = Faults(args.fail_rate, args.fail_after_charge_rate, args.latency_ms, args.seed)
    _serve(create_app(db, faults), args)
    db.dispose()
    return 0


def _api(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import httpx

    import recoverypoint as rp

    from .api import async_ride_operation, create_app, ride_operation
    from .schema import require

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per provider call is noise
    engine = rp.Engine(args.database_url)
    require(engine.db, "users", "rides", "audit_records", "idempotency_keys")
    lock_timeout = timedelta(seconds=args.lock_timeout)
    async_engine = rp.AsyncEngine(args.database_url) if args.asynchronous else None
    with httpx.Client(base_url=args.provider_url, timeout=10.0) as provider:
        if async_engine is None:
            app = create_app(engine, ride_operation(provider, lock_timeout))
        else:
            # Used on uvicorn's event loop, and closed with the process.
            client = httpx.AsyncClient(base_url=args.provider_url, timeout=10.0)
            rides = async_ride_operation(client, lock_timeout)
            app = create_app(engine, rides, async_engine=async_engine)
        _serve(app, args)
    engine.dispose()
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from .simulate import simulate

    return asyncio.run(simulate(args.api_url, args.requests, args.concurrency, args.seed))


if __name__ == "__main__":
    raise SystemExit(program(main))
