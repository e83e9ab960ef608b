"""``recoverypoint explore MODULE:NAME``: every crash schedule of an operation, on a
throwaway database, with a summary table and the smallest failing schedule."""

from __future__ import annotations

import argparse
import os
import pkgutil
import sys
import time

from ..database import DATABASE_URL_ENV, normalize_url
from ..exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail
from ..explore import KILLING, KINDS, Exploration, Subject
from ..migrate import upgrade
from ._common import Subparsers
from ._output import print_json, print_table
from .demo import throwaway_database
from .worker import positive_int


def add_explore(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "explore",
        help="crash an operation at every boundary, recover it, and check every invariant",
        description=(
            "Build the operation with NAME(database_url), a function in MODULE returning a "
            "recoverypoint.explore.Subject, on a database created for the run and dropped "
            "after it; run it once per crash schedule (a crash at every boundary, then the "
            "client's retry or the completer, and the enqueuer, with crashes during that "
            "too, up to --depth crashes; a new process after each crash) and check "
            "recoverypoint's invariants and the subject's after each. Exits 1 with the "
            "smallest failing schedule, at the first depth that has one."
        ),
    )
    parser.add_argument("subject", metavar="MODULE:NAME", help="e.g. myapp.checkout:explore")
    parser.add_argument(
        "--depth", type=positive_int, default=2, metavar="N", help="crashes per schedule (2)"
    )
    parser.add_argument(
        "--schedule", metavar="TEXT", help="run this schedule alone (a report's reproduce line)"
    )
    parser.add_argument(
        "--no-exit",
        action="store_true",
        help="never kill an attempt's process (no death, no failover): crash by exceptions",
    )
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        help="a PostgreSQL server to run on, in a database created and dropped for the run "
        f"(default: ${DATABASE_URL_ENV}, else an embedded server)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.set_defaults(handler=_explore)


def _explore(args: argparse.Namespace) -> int:
    if os.getcwd() not in sys.path:  # MODULE may be the user's, as for `worker --app`
        sys.path.insert(0, os.getcwd())
    try:
        build = pkgutil.resolve_name(args.subject)
    except (ImportError, AttributeError, ValueError) as exc:
        return fail("explore", EXIT_USAGE, f"cannot load {args.subject}: {exc}")
    if not callable(build):
        return fail("explore", EXIT_USAGE, f"{args.subject} is not a function of a database URL")
    try:
        server = normalize_url(args.database_url) if args.database_url else None
    except ValueError as exc:
        return fail("explore", EXIT_USAGE, str(exc))
    progress = _Progress()
    with throwaway_database(
        server.render_as_string(hide_password=False) if server else None
    ) as url:
        upgrade(url)
        subject = build(url)
        if not isinstance(subject, Subject):
            return fail(
                "explore",
                EXIT_USAGE,
                f"{args.subject} returned {type(subject).__name__}, "
                "not a recoverypoint.explore.Subject",
            )
        try:
            found = subject.explore(
                depth=args.depth,
                schedule=args.schedule,
                effects=[k for k in KINDS if not (args.no_exit and k in KILLING)],
                progress=progress,
            )
        except ValueError as exc:
            return fail("explore", EXIT_USAGE, str(exc))
        finally:
            progress.close()
            for db in (subject.engine.db, *subject.dispose):
                db.dispose()
    _print(found, args.json)
    if found.failures and not args.json:
        schedule = found.failures[0].schedule
        print(f'run it alone: recoverypoint explore {args.subject} --schedule "{schedule}"')
    return EXIT_OK if found.ok else EXIT_FAILED


def _print(found: Exploration, as_json: bool) -> None:
    if as_json:
        print_json(
            {
                "operation": found.operation,
                "ok": found.ok,
                "depth": found.reached,
                "schedules": found.schedules,
                "seconds": round(found.seconds, 3),
                "by_depth": dict(found.by_depth),
                "past_window": found.past_window,
                "failures": [
                    {"schedule": str(f.schedule), "invariant": f.invariant, "detail": f.detail}
                    for f in found.failures
                ],
            }
        )
        return
    failed = {depth: 0 for depth in found.by_depth}
    for failure in found.failures:
        failed[failure.schedule.depth] += 1
    rows = [(depth, found.by_depth[depth], failed[depth]) for depth in sorted(found.by_depth)]
    print_table(["crashes", "schedules", "broke an invariant"], rows)
    print(found.report())


class _Progress:
    """Schedules done of those known so far, on stderr: in place on a terminal, else a
    line every few seconds."""

    def __init__(self) -> None:
        self.interactive = sys.stderr.isatty()
        self.began = self.last = time.monotonic()

    def __call__(self, done: int, known: int) -> None:
        now = time.monotonic()
        line = f"explore: {done}/{known} schedules  {now - self.began:.0f}s"
        if self.interactive:
            sys.stderr.write("\r" + line)
        elif now - self.last >= 5 or done == known:
            self.last = now
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.interactive:
            sys.stderr.write("\n")
