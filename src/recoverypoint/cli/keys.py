"""``recoverypoint keys list|show|stats`` (reading) and, from :mod:`.key_actions`,
``retry|release|abandon|reopen|delete|purge`` (changing)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime

from .. import admin
from ..exits import EXIT_OK
from ._app import UsageError
from ._common import Subparsers, admin_for, guarded, record_id
from ._output import due, print_fields, print_json, print_table, seconds, truncate
from ._selection import KEY_HEADERS, add_common, add_filters, key_cells, key_filter
from .key_actions import add_key_actions


def add_keys(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="find, explain and fix idempotency keys",
        description=(
            "States: in-flight (a request holds a live lease), stuck (unfinished, no live "
            "lease, next attempt overdue by more than --stuck-after), unfinished (waiting for "
            "its next attempt or its client), finished, abandoned. Scopes, params, phase "
            "outputs, responses and fingerprints are masked (keyed) unless --reveal. Exit "
            "status: 0 done, 1 failed, 2 usage, 3 not found, "
            "4 refused (nothing was done)."
        ),
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    listing = commands.add_parser("list", help="keys, newest first, with filters")
    add_filters(listing, most=50)
    add_common(listing)
    listing.set_defaults(handler=guarded("keys list", _list))

    show = commands.add_parser("show", help="everything about one key")
    show.add_argument("id", type=record_id, nargs="?", help="the key record's id")
    show.add_argument("--scope", help="with --operation and --key: name the key instead of ID")
    show.add_argument("--operation")
    show.add_argument("--key")
    add_common(show)
    show.set_defaults(handler=guarded("keys show", _show))

    figures = commands.add_parser("stats", help="counts by operation, state and recovery point")
    add_common(figures, reveal=False)
    figures.set_defaults(handler=guarded("keys stats", _stats))

    add_key_actions(commands)


def _list(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        rows = admin.list_keys(ops, key_filter(args), reveal=args.reveal)
    if args.json:
        print_json(rows)
    else:
        print_table(KEY_HEADERS, [key_cells(row, ops) for row in rows])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        if args.id is None and not (args.scope and args.operation and args.key):
            raise UsageError("name the key: keys show ID, or --scope S --operation O --key K")
        detail = admin.find_key(
            ops, args.id, scope=args.scope, operation=args.operation, key=args.key,
            reveal=args.reveal,
        )  # fmt: skip
    if args.json:
        print_json(detail)
    else:
        _print_detail(detail)
    return EXIT_OK


def _print_detail(detail: admin.KeyDetail) -> None:
    row = detail.row
    if row.lock_token is None or row.finished:
        lease = "free"
    elif row.lease_left is None:
        lease = f"token {row.lock_token}, taken {_at(row.locked_at)}, live: deadline unknown"
    else:
        left = row.lease_left
        state = f"{seconds(left)} left" if left > 0 else f"expired {seconds(left)} ago"
        lease = (
            f"token {row.lock_token}, taken {_at(row.locked_at)}, until "
            f"{_at(detail.lease_expires_at)} ({state})"
        )
    timeout = (
        "unknown (the lease was taken before migration 0010: pass --app)"
        if row.lock_timeout is None
        else f"{row.lock_timeout:g}s"
    )
    print_fields(
        [
            ("id", row.id),
            ("operation", f"{row.operation}@{row.version}"),
            ("scope", row.scope),
            ("key", row.key),
            ("state", ", ".join(filter(None, (row.state, detail.compensation)))),
            ("recovery point", row.point),
            *([("dedupe window", detail.window)] if detail.window else []),
            ("request", f"{detail.request_method} {detail.request_path}"),
            ("params", _json(detail.request_params)),
            ("fingerprint", detail.fingerprint),
            ("attempts", row.attempts),
            ("next attempt", None if row.finished else _next_attempt(row)),
            ("lease", lease),
            ("lock timeout", timeout),
            ("last error", row.last_error),
            ("created", f"{_at(row.created_at)} ({seconds(row.age)} ago)"),
            ("last run", row.last_run_at),
            ("finished", row.finished_at),
            ("abandoned", row.abandoned_at),
            ("response", row.status and f"{row.status} {_json(detail.response_body)}"),
            ("reaper deletes it after", detail.reaped_after),
            ("state (phase outputs)", _json(detail.phase_state)),
        ]
    )  # fmt: skip
    print()
    if detail.phases:
        print("phases:")
        print_table(
            ("", "recovery point", "kind", "downstream key"),
            [(_MARKS[p.mark], p.point, p.kind, p.downstream_key) for p in detail.phases],
        )
    else:
        print(
            f"phases: operation {row.operation}@{row.version} is not known here; pass --app "
            "MODULE:ATTR to see its phases and downstream keys"
        )
    print()
    if detail.jobs:
        print("staged jobs:")
        print_table(
            ("id", "job", "job key", "attempts", "age", "last error"),
            [
                (j.id, j.job_name, j.job_key, j.attempts, seconds(j.age), truncate(j.last_error))
                for j in detail.jobs
            ],
        )
    else:
        print("staged jobs: none waiting")


_MARKS = {"done": "✓", "current": "→", "pending": "", "unknown": "?"}


def _next_attempt(row: admin.KeyRow) -> str:
    return f"{_at(row.next_attempt_at)} ({due(row.next_attempt_in)})"


def _at(moment: datetime | None) -> str:
    return "-" if moment is None else moment.isoformat(timespec="seconds")


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _stats(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        figures = admin.stats(ops)
    if args.json:
        print_json(figures)
        return EXIT_OK
    print_table(
        ("operation", "state", "recovery point", "keys", "oldest"),
        [
            (f"{g.operation}@{g.version}", g.state, g.point, g.keys, seconds(g.oldest))
            for g in figures.groups
        ],
    )
    print()
    print_fields(
        [
            *((state, count) for state, count in figures.by_state.items()),
            ("oldest unfinished", seconds(figures.oldest_unfinished)),
            ("staged jobs", figures.staged_jobs),
            ("failing jobs", figures.failing_jobs),
            ("oldest job", seconds(figures.oldest_job)),
        ]
    )
    return EXIT_OK
