"""``recoverypoint worker completer|reaper|enqueuer|all --app module:attr``.

``--app`` names your :class:`~recoverypoint.Engine` or :class:`~recoverypoint.AsyncEngine`,
with its operations registered and its job backend set, as ``uvicorn`` and ``celery -A``
name an application; an application with both passes ``--app`` twice, and one completer
resumes the keys of both. The command checks
the database and its schema first and exits with status 1, in one line, when either is
not usable. ``all`` runs the three workers in threads of one process; should one of them
crash, the others stop too and the command fails. SIGTERM or SIGINT stops the workers
after their current batch, and the command exits with status 0. ``--once`` exits with
status 1 when its pass found keys or jobs no running worker can finish (an operation
version no running completer registers, a job the backend has no handler for), each
logged as an error that says what to import.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from ..admin.base import DEFAULT_ABANDONED_RETENTION, DEFAULT_RETENTION
from ..exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, fail
from ..generations import DEFAULT_GENERATIONS_RETENTION
from ..logfmt import logfmt
from ..migrate import VERSION_TABLE, history
from ..workers.completer import Completer, CompleterResult
from ..workers.engines import Engines
from ..workers.enqueuer import Enqueuer
from ..workers.loop import STRUCTURED, Worker, log_event, on_stop
from ..workers.reaper import DEFAULT_VACUUM_AFTER, Reaper
from ._app import UsageError, dispose, load_engines
from ._common import Subparsers as _Subparsers

# `all` runs them in this order with --once: keys the completer finishes stage jobs for
# the enqueuer; the reaper goes last.
KINDS = ("completer", "enqueuer", "reaper")


_CURRENT_REVISION = sa.text(f"SELECT version_num FROM {VERSION_TABLE}")


class StartError(Exception):
    """The database cannot be used: exit status 1."""


def add_worker(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run the completer, reaper or enqueuer (or all three)",
        description=(
            "Run recoverypoint's workers against your engine. Any number of instances may "
            "run side by side. Durations are seconds, or a number with s, m, h or d."
        ),
    )
    parser.add_argument("kind", choices=(*KINDS, "all"), help="which worker to run")
    parser.add_argument(
        "--app",
        required=True,
        action="append",
        metavar="MODULE:ATTR",
        help="your recoverypoint Engine or AsyncEngine, e.g. myapp.jobs:engine (MODULE is "
        "imported from the current directory too); twice for an application with both",
    )
    parser.add_argument(
        "--once", action="store_true", help="run one pass (until nothing is left), then exit"
    )
    parser.add_argument(
        "--interval",
        type=_duration,
        metavar="DURATION",
        help="pause between passes when idle (default: completer 5s, enqueuer 1s, reaper 60s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="N",
        help="rows per transaction (default: completer 10, enqueuer 100, reaper 1000); the "
        "completer resumes a batch's keys of an AsyncEngine all at once",
    )
    parser.add_argument(
        "--min-age",
        type=_duration,
        default=60.0,
        metavar="DURATION",
        help="completer: how long an unfinished key waits for its own client after its last "
        "attempt before the completer takes it (default 60s; 0 takes it when due); a key "
        "retried by an operator (keys retry) is taken at once",
    )
    parser.add_argument(
        "--retention",
        type=_duration,
        default=DEFAULT_RETENTION.total_seconds(),
        metavar="DURATION",
        help="reaper: delete finished keys this old (default 72h)",
    )
    parser.add_argument(
        "--abandoned-retention",
        type=_duration,
        default=DEFAULT_ABANDONED_RETENTION.total_seconds(),
        metavar="DURATION",
        help="reaper: delete abandoned keys this old (default 30d)",
    )
    parser.add_argument(
        "--generations-retention",
        type=_duration,
        default=DEFAULT_GENERATIONS_RETENTION.total_seconds(),
        metavar="DURATION",
        help="reaper: forget a deleted key's generation this long after its deletion, so "
        "that a reuse derives its first request's keys again; longer than any provider "
        "remembers a key (default 30d)",
    )
    parser.add_argument(
        "--vacuum-after",
        type=int,
        default=DEFAULT_VACUUM_AFTER,
        metavar="ROWS",
        help="reaper: VACUUM (ANALYZE) a table after deleting this many rows from it in one "
        f"pass, when autovacuum is off for it (default {DEFAULT_VACUUM_AFTER:,}; 0: never)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="default INFO",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    with _logging(args.log_level):
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    try:
        engines = load_engines(args.app)
        _check_database(engines.db)
        stop = threading.Event()
        workers = _workers(engines, args, stop)
    except UsageError as exc:
        return fail("worker", EXIT_USAGE, str(exc))
    except StartError as exc:
        return fail("worker", EXIT_FAILED, str(exc))
    try:
        with on_stop(stop.set):
            if args.once:
                stranded: dict[str, int] = {}
                for worker in workers:
                    if not worker.stopping:
                        result = worker.run_once()
                        worker.log_pass(result)
                        if isinstance(result, CompleterResult) and (why := held_back(result, args)):
                            print(f"completer: {why}", file=sys.stderr)
                        if result.stranded:
                            stranded[worker.name] = result.stranded
                if stranded:
                    return fail("worker", EXIT_FAILED, _stranded(stranded))
                return EXIT_OK
            if len(workers) == 1:
                workers[0].run_forever(args.interval)
                return EXIT_OK
            return _run_threads(workers, args.interval, stop)
    except KeyboardInterrupt:
        # A second signal: the batch in progress was abandoned and rolls back.
        log_event(logging.WARNING, "interrupted", {"workers": args.kind})
        return EXIT_INTERRUPTED
    finally:
        for worker in workers:
            if isinstance(worker, Completer):
                worker.close()  # its event loop, before the pools are closed
        dispose(engines)


def held_back(result: CompleterResult, args: argparse.Namespace) -> str:
    """Why a pass left keys unfinished, and what takes them, in a sentence ("" if none)."""
    reasons = []
    if result.too_recent:
        reasons.append(
            f"{_keys(result.too_recent)} younger than --min-age {args.min_age:g}s, which "
            "leaves their clients time to retry (--min-age 0, or recoverypoint keys retry ID, "
            "takes them now)"
        )
    if result.backing_off:
        reasons.append(
            f"{_keys(result.backing_off)} whose next attempt is not due yet "
            "(recoverypoint keys retry ID makes it due now)"
        )
    if result.leased:
        reasons.append(f"{_keys(result.leased)} a running request holds")
    return "skipped " + "; ".join(reasons) if reasons else ""


def _keys(count: int) -> str:
    return f"{count} key" if count == 1 else f"{count} keys"


def _stranded(counts: dict[str, int]) -> str:
    """What a single pass left that no running worker can finish, by the worker that found
    it (the completer keys, the enqueuer jobs), in a sentence."""
    found, events = [], []
    for kind, count in counts.items():
        if kind == "completer":
            found.append(_keys(count))
            events.append("event=unfinishable")
        else:
            found.append(f"{count} job{'' if count == 1 else 's'}")
            events.append("event=unknown_job")
    return (
        f"the pass left {' and '.join(found)} that no running worker can finish, logged "
        f"above ({', '.join(events)}) with what the --app module must import"
    )


def _run_threads(workers: list[Worker[Any]], interval: float | None, stop: threading.Event) -> int:
    """Each worker in a thread of its own; the first to crash stops all of them."""
    crashed: list[str] = []

    def run(worker: Worker[Any]) -> None:
        try:
            worker.run_forever(interval)
        except BaseException as exc:
            crashed.append(worker.name)
            fields = {"worker": worker.name, "error": repr(exc)}
            log_event(logging.CRITICAL, "crashed", fields, exc_info=True)
            stop.set()

    threads = [
        # daemon: after a second signal the process exits without waiting for them; their
        # open transactions die with the connections and roll back.
        threading.Thread(target=run, args=(worker,), name=worker.name, daemon=True)
        for worker in workers
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        # Short joins keep the main thread responsive to signals.
        for thread in threads:
            thread.join(0.2)
    return EXIT_FAILED if crashed else EXIT_OK


def _check_database(db: sa.Engine) -> None:
    """Connect once and check that the schema is at (or past) this version's head."""
    url = db.url.render_as_string(hide_password=True)
    try:
        with db.connect() as conn:
            migrated = sa.inspect(conn).has_table(VERSION_TABLE)
            current = conn.execute(_CURRENT_REVISION).scalar() if migrated else None
    except DBAPIError as exc:
        # The driver's message, joined into one line: refused, unknown database, password.
        raise StartError(f"{url}: {' '.join(str(exc.orig or exc).split())}") from exc
    ours = history()
    # A revision we do not know is a newer recoverypoint's: its schema still has ours.
    if current != ours.head and (current is None or current in ours.revisions):
        raise StartError(
            f"{url}: recoverypoint's schema is at revision {current or 'none'}, the workers "
            f"need {ours.head}: run `recoverypoint migrate` first"
        )


def _workers(
    engines: Engines, args: argparse.Namespace, stop: threading.Event
) -> list[Worker[Any]]:
    served = engines.all  # each worker takes the application's engines, one or two
    factories: dict[str, Callable[[], Worker[Any]]] = {
        "completer": lambda: Completer(
            served, batch_size=args.batch_size, min_age=args.min_age, stop_event=stop, app=args.app
        ),
        "enqueuer": lambda: Enqueuer(
            served, batch_size=args.batch_size, stop_event=stop, app=args.app
        ),
        "reaper": lambda: Reaper(
            served,
            batch_size=args.batch_size,
            retention=timedelta(seconds=args.retention),
            abandoned_retention=timedelta(seconds=args.abandoned_retention),
            generations_retention=timedelta(seconds=args.generations_retention),
            vacuum_after=args.vacuum_after or None,
            stop_event=stop,
        ),
    }
    kinds = KINDS if args.kind == "all" else (args.kind,)
    try:
        return [factories[kind]() for kind in kinds]
    except ValueError as exc:  # a worker refused its settings, or no job backend
        raise UsageError(str(exc)) from exc


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 0, 30, 90s, 72h, 30d)")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


class _LogfmtFormatter(logging.Formatter):
    """``ts=… level=… logger=…`` then the event's own pairs; other libraries' messages
    (and tracebacks) become quoted ``msg=`` and ``exc=`` values, so every line parses."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        head = logfmt(
            ts=f"{ts}.{int(record.msecs):03d}Z",
            level=record.levelname.lower(),
            logger=record.name,
        )
        message = record.getMessage()
        body = message if getattr(record, STRUCTURED, False) else logfmt(msg=message)
        if record.exc_info:
            body += " " + logfmt(exc=self.formatException(record.exc_info))
        return f"{head} {body}"


@contextmanager
def _logging(level: str) -> Iterator[None]:
    """The root logger, while the workers run: logfmt lines on stderr from ``level`` up.
    Put back as it was once they are done, for a process that goes on after the command
    (Django's ``call_command``, a test): left set, it would log every library's INFO
    lines (httpx's, one per request) to a stderr that may be closed by then."""
    root = logging.getLogger()
    handlers, before = list(root.handlers), root.level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogfmtFormatter())
    root.handlers[:] = [handler]
    root.setLevel(level)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(before)
