"""``recoverypoint metrics serve``: the database gauges on ``/metrics`` for Prometheus.

The gauges every process shares (keys in flight, stuck, abandoned; staged jobs) are read
from the database at each scrape. The counters of a process (requests, phases, jobs) live
in that process: route ``/metrics`` to ``MetricsApp(registry)`` in your application for
those (see :mod:`recoverypoint.integrations.prometheus`).
"""

from __future__ import annotations

import argparse
import os
import threading
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from ..database import DATABASE_URL_ENV, create_engine, normalize_url
from ..exits import EXIT_OK, EXIT_USAGE, fail
from ..operation import Operation
from ..workers.loop import on_stop
from ._app import UsageError, load_engines
from ._common import Subparsers, add_stuck_after, address, described

DEFAULT_BIND = "127.0.0.1:9464"  # 9464: the port OpenTelemetry's Prometheus exporter uses


def add_metrics(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "metrics", help="serve Prometheus metrics", description=described(__doc__)
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the database gauges on /metrics until SIGTERM or SIGINT",
        description="Serve recoverypoint's database gauges on http://BIND/metrics, read "
        "at every scrape.",
    )
    serve.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_BIND}; port 0 picks a free one)",
    )
    serve.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        help=f"postgresql://user:password@host:port/database (default: ${DATABASE_URL_ENV}; "
        "else the database of --app)",
    )
    serve.add_argument(
        "--app",
        action="append",
        metavar="MODULE:ATTR",
        help="your recoverypoint Engine or AsyncEngine, twice for both: their operations "
        "give keys their lock timeout, and each of them a series even at 0",
    )
    add_stuck_after(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server

        from ..integrations.prometheus_collector import DatabaseCollector
    except ImportError:
        return fail(
            "metrics",
            EXIT_USAGE,
            "prometheus_client is missing: pip install 'recoverypoint[metrics]'",
        )
    try:
        host, port = address(args.bind, DEFAULT_BIND)
        db, operations = _database(args)
    except (UsageError, ValueError) as exc:
        return fail("metrics", EXIT_USAGE, str(exc))
    registry = CollectorRegistry()
    stuck_after = timedelta(seconds=args.stuck_after)
    registry.register(DatabaseCollector(db, operations, stuck_after=stuck_after))
    server, thread = start_http_server(port, addr=host, registry=registry)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving metrics on http://{shown}:{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    try:
        with on_stop(stop.set):
            stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        if args.database_url:  # ours; the --app engine's pool is the application's
            db.dispose()
    return EXIT_OK


def _database(args: argparse.Namespace) -> tuple[sa.Engine, tuple[Operation[Any], ...]]:
    engines = load_engines(args.app) if args.app else None
    operations = engines.operations if engines is not None else ()
    if args.database_url:
        # NullPool: a scrape every 15 s or so needs no connection kept open between them.
        return create_engine(normalize_url(args.database_url), poolclass=NullPool), operations
    if engines is not None:
        return engines.db, operations
    raise UsageError(
        f"no database: pass --database-url postgresql://user:password@host/db, "
        f"set {DATABASE_URL_ENV}, or pass --app MODULE:ATTR"
    )
