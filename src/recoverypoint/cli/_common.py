"""What every operator command shares: its database options, how it builds the
:class:`~recoverypoint.admin.Admin`, how failures become one line and an exit status, the
audit log on stderr, and confirmation."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import TypeAlias

from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ..admin import Admin, NotFound, Refused
from ..database import DATABASE_URL_ENV, create_engine, normalize_url
from ..exits import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_USAGE, fail
from ..logfmt import logfmt
from ._app import UsageError, load_engines

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Handler: TypeAlias = Callable[[argparse.Namespace], int]


def described(doc: str) -> str:
    """A command module's docstring as its ``--help`` description: the first paragraph,
    without the ``recoverypoint <command>``: it opens with (the usage line above says it)
    and without reST markup, which a terminal shows as stray backticks."""
    first = " ".join(doc.split("\n\n")[0].split())
    first = re.sub(r"^``recoverypoint [\w -]+``:\s*", "", first).replace("``", "")
    return first[:1].upper() + first[1:]


def add_database_options(parser: argparse.ArgumentParser, *, json: bool = True) -> None:
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        help=f"postgresql://user:password@host:port/database (default: ${DATABASE_URL_ENV}; "
        "else the database of --app)",
    )
    parser.add_argument(
        "--app",
        action="append",
        metavar="MODULE:ATTR",
        help="your recoverypoint Engine or AsyncEngine, twice for both (as for `recoverypoint "
        "worker`): their operations give keys their lock timeout, phases and downstream keys",
    )
    if json:
        parser.add_argument("--json", action="store_true", help="print JSON, for scripts")


def add_stuck_after(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stuck-after",
        type=duration,
        default=300.0,
        metavar="DURATION",
        help="an unleased key whose next attempt is overdue this long is stuck (default 5m)",
    )


@contextmanager
def admin_for(args: argparse.Namespace) -> Iterator[Admin]:
    """The Admin the options name: --database-url (or $RECOVERYPOINT_DATABASE_URL) for the
    database, --app for the operations (and the database, when no URL is given)."""
    engines = load_engines(args.app) if args.app else None
    if args.database_url:
        try:
            url = normalize_url(args.database_url)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        db = create_engine(url, poolclass=NullPool)
    elif engines is not None:
        db = engines.db
    else:
        raise UsageError(
            f"no database: pass --database-url postgresql://user:password@host/db, "
            f"set {DATABASE_URL_ENV}, or pass --app MODULE:ATTR"
        )
    stuck_after = timedelta(seconds=getattr(args, "stuck_after", 300.0))
    operations = engines.operations if engines is not None else ()
    try:
        yield Admin(db, operations, stuck_after=stuck_after, via="cli")
    finally:
        if args.database_url:  # ours; the --app engine's pool is the application's
            db.dispose()


def guarded(command: str, handler: Handler) -> Handler:
    """``handler`` with its failures turned into one line on stderr and an exit status."""

    def run(args: argparse.Namespace) -> int:
        _log_actions()
        try:
            return handler(args)
        except UsageError as exc:
            return fail(command, EXIT_USAGE, str(exc))
        except ValueError as exc:  # a value the library refused: a bad --status, say
            return fail(command, EXIT_USAGE, str(exc))
        except NotFound as exc:
            return fail(command, EXIT_NOT_FOUND, str(exc))
        except Refused as exc:
            return fail(command, EXIT_REFUSED, str(exc))
        except DBAPIError as exc:
            # The driver's message (refused, no such table, password) in one line.
            return fail(command, EXIT_FAILED, " ".join(str(exc.orig or exc).split()))

    return run


def confirm(question: str, yes: bool) -> None:
    """Go on if ``yes`` or a person at the terminal answers y; else :class:`Refused`."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{question} Pass --yes to confirm (stdin is not a terminal)")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise Refused("not confirmed: nothing was done")


def address(bind: str, example: str) -> tuple[str, int]:
    """``--bind HOST:PORT`` (an IPv6 host in brackets) as a host and a port."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--bind must be HOST:PORT, e.g. {example}; got {bind!r}")
    return host, int(port)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# A century: every duration an operator means, and every instant that far back, fit in
# a datetime and a PostgreSQL interval (a longer one overflowed both).
_LONGEST = 36500 * 86400


def duration(text: str) -> float:
    """Seconds, or a number with s, m, h or d; at most 36500d."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 0, 30, 90s, 72h, 30d)")
    seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    if seconds > _LONGEST:
        raise argparse.ArgumentTypeError(f"too long: {text!r} (at most 36500d, a century)")
    return seconds


def integer(what: str, low: int, high: int) -> Callable[[str], int]:
    """An argument type: a whole number from ``low`` to ``high`` (what the column it is
    compared with holds), else a usage error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} is from {low} to {high}; got {text}")
        return value

    return parse


record_id = integer("an id", 1, 2**63 - 1)  # a bigint identity
version_number = integer("a version", 0, 2**31 - 1)
http_status = integer("an HTTP status", 100, 599)
row_limit = integer("a limit", 0, 2**63 - 1)


def instant(text: str) -> datetime:
    """An ISO 8601 time (UTC when it names no zone), or a duration ago (``2h``)."""
    if _DURATION.fullmatch(text.strip()):
        return datetime.now(timezone.utc) - timedelta(seconds=duration(text))
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (e.g. 2025-06-01T12:00:00+00:00, or 2h for two hours ago)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class _AuditHandler(logging.Handler):
    """The audit lines on whatever ``sys.stderr`` is when they are written."""

    def emit(self, record: logging.LogRecord) -> None:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        head = logfmt(ts=f"{ts}Z", level=record.levelname.lower(), logger=record.name)
        print(f"{head} {record.getMessage()}", file=sys.stderr)


def _log_actions() -> None:
    logger = logging.getLogger("recoverypoint.admin")
    if not any(isinstance(h, _AuditHandler) for h in logger.handlers):
        logger.addHandler(_AuditHandler())
    logger.setLevel(logging.INFO)
