"""``recoverypoint demo``: Rocket Rides under faults, then the invariants checked."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from ..database import DATABASE_URL_ENV, normalize_url
from ..demo.existing import existing_database
from ..demo.faults import FaultMix
from ..embedded import embedded_database
from ..errors import ConfigurationError
from ..exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail
from ..testing import temporary_database
from ._common import Subparsers as _Subparsers
from .worker import positive_int


def add_demo(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="book rides through crashes and faults, then check that nothing was lost or doubled",
        description=(
            "Run the Rocket Rides example (payment provider, API, completer, enqueuer) as "
            "separate processes, kill and fail them at random while clients book rides, "
            "then check the database: no ride charged twice, no request lost, every receipt "
            "sent once. Exits 1 if any invariant fails. Needs the demo extra: "
            "pip install 'recoverypoint[demo]'."
        ),
    )
    parser.add_argument(
        "--requests", type=positive_int, default=500, metavar="N", help="default 500"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        metavar="C",
        help="clients at once (default 8)",
    )
    parser.add_argument(
        "--faults",
        type=float,
        default=20.0,
        metavar="PERCENT",
        help="about this share of request attempts meet a fault (default 20; 0 for none)",
    )
    parser.add_argument("--seed", type=int, default=None, help="repeat a run (default: random)")
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="run the API's operation on rp.AsyncEngine (async def phases, on the event "
        "loop), and the workers on that engine alone",
    )
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        help="a PostgreSQL server to run on, in a database the demo creates and drops "
        f"(default: ${DATABASE_URL_ENV}, else an embedded server)",
    )
    parser.add_argument(
        "--existing",
        action="store_true",
        help="run in the database the URL names, which you made (on Citus: a coordinator's, "
        "created on every node), instead of one the demo creates: the demo migrates it, "
        "leaves your tables alone, and removes its own afterwards",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON"
    )
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    try:
        # Here, not at the top: the demo's dependencies (httpx, the example's FastAPI) are
        # an extra, and the other commands must run without them.
        from ..demo.harness import DemoConfig, run
        from ..demo.progress import ProgressBar
    except ImportError as exc:
        hint = "install the demo's extra: pip install 'recoverypoint[demo]'"
        return fail("demo", EXIT_USAGE, f"{exc}: {hint}")
    try:
        faults = FaultMix.from_percent(args.faults)
        url = normalize_url(args.database_url) if args.database_url else None
    except ValueError as exc:
        return fail("demo", EXIT_USAGE, str(exc))
    if args.existing and url is None:
        return fail(
            "demo", EXIT_USAGE, f"--existing needs --database-url URL (or ${DATABASE_URL_ENV})"
        )
    seed = args.seed if args.seed is not None else random.randrange(1, 1_000_000)
    config = DemoConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        faults=faults,
        seed=seed,
        asynchronous=args.asynchronous,
    )
    where = url.render_as_string(hide_password=True) if url else "an embedded PostgreSQL"
    print(
        f"Rocket Rides: {config.requests} rides from {config.concurrency} clients, on {where}, "
        f"the API on {'rp.AsyncEngine' if config.asynchronous else 'rp.Engine'}\n"
        f"faults ({args.faults:g}%): {faults.describe()}\n"
        f"seed {seed} (--seed {seed} repeats its requests and fault draws)",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="recoverypoint-demo-"))
    bar = ProgressBar()
    try:
        server = url.render_as_string(hide_password=False) if url else None
        with _database(server, existing=args.existing) as database:
            report = run(config, database, workdir, progress=bar)
    except ConfigurationError as exc:
        bar.close()
        return fail("demo", EXIT_USAGE, str(exc))
    except (DBAPIError, RuntimeError) as exc:
        bar.close()
        detail = " ".join(str(getattr(exc, "orig", None) or exc).split())
        return fail("demo", EXIT_FAILED, f"{detail} (logs in {workdir})")
    except KeyboardInterrupt:
        bar.close()
        return fail("demo", EXIT_FAILED, f"interrupted (logs in {workdir})")
    bar.close()
    print(report.table())
    if args.json:
        report.write_json(args.json)
    if report.ok:
        shutil.rmtree(workdir, ignore_errors=True)
        return EXIT_OK
    print(f"the processes' logs are in {workdir}", file=sys.stderr)
    return EXIT_FAILED


@contextmanager
def _database(server_url: str | None, *, existing: bool) -> Iterator[str]:
    """The database the run is in: the one ``server_url`` names with ``existing``, else a
    throwaway one."""
    if existing:
        assert server_url is not None  # --existing without a URL is refused before
        with existing_database(server_url) as url:
            yield url
    else:
        with throwaway_database(server_url) as url:
            yield url


@contextmanager
def throwaway_database(server_url: str | None) -> Iterator[str]:
    """A database of the run's own: every row in it is the run's, so the checks can count."""
    if server_url is None:
        print("starting an embedded PostgreSQL...", file=sys.stderr, flush=True)
        with embedded_database() as url:
            yield url
    else:
        with temporary_database(server_url, prefix="rp_demo") as url:
            yield url
