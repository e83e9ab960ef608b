"""The key selection the ``keys`` commands share: filter options, and a key as a table row."""

from __future__ import annotations

import argparse

from .. import admin
from ._common import (
    add_database_options,
    add_stuck_after,
    http_status,
    instant,
    row_limit,
    version_number,
)
from ._output import due, seconds, truncate


def add_common(parser: argparse.ArgumentParser, *, reveal: bool = True) -> None:
    add_database_options(parser)
    add_stuck_after(parser)
    if reveal:
        parser.add_argument(
            "--reveal",
            action="store_true",
            help="show scopes, params, phase outputs and responses unmasked",
        )


def add_filters(parser: argparse.ArgumentParser, *, most: int) -> None:
    group = parser.add_argument_group("filters (all must match)")
    group.add_argument("--operation", metavar="NAME")
    group.add_argument("--version", type=version_number, metavar="N", help="operation version")
    group.add_argument(
        "--scope", help="the scope (customer, tenant) as the application names it, unmasked"
    )
    group.add_argument("--key", metavar="KEY", help="the client's idempotency key")
    group.add_argument(
        "--state",
        action="append",
        choices=admin.STATES,
        help="repeat for several: --state stuck --state unfinished",
    )
    group.add_argument("--point", metavar="NAME", help="recovery point")
    group.add_argument(
        "--since", type=instant, metavar="TIME", help="created at or after: ISO time, or 2h ago"
    )
    group.add_argument("--until", type=instant, metavar="TIME", help="created before")
    group.add_argument("--status", type=http_status, metavar="CODE", help="stored response status")
    group.add_argument(
        "--limit",
        type=row_limit,
        default=most,
        metavar="N",
        help=f"at most N keys (default {most})",
    )


def key_filter(args: argparse.Namespace, ids: tuple[int, ...] = ()) -> admin.KeyFilter:
    return admin.KeyFilter(
        ids=ids,
        operation=args.operation,
        version=args.version,
        scope=args.scope,
        key=args.key,
        states=tuple(args.state or ()),
        point=args.point,
        since=args.since,
        until=args.until,
        status=args.status,
        limit=args.limit,
    )


KEY_HEADERS = (
    "id",
    "operation",
    "scope",
    "key",
    "recovery point",
    "state",
    "attempts",
    "next attempt",
    "lease left",
    "status",
    "age",
    "last error",
)


def key_cells(row: admin.KeyRow, ops: admin.Admin | None = None) -> list[object]:
    """A key's cells under :data:`KEY_HEADERS`; ``ops`` knows its operation's compensation."""
    lease = None
    if row.live:
        lease = "unknown" if row.lease_left is None else seconds(row.lease_left)
    elif row.lease_left is not None:
        lease = "expired"
    return [
        row.id,
        f"{row.operation}@{row.version}",
        truncate(row.scope, 36),
        truncate(row.key, 36),
        row.point,
        _state(row, ops),
        row.attempts,
        None if row.finished else due(row.next_attempt_in),
        lease,
        row.status,
        seconds(row.age),
        truncate(row.last_error),
    ]


def _state(row: admin.KeyRow, ops: admin.Admin | None) -> str:
    operation = None if ops is None else ops.operation(row.operation, row.version)
    compensation = admin.compensation_state(row, operation)
    return row.state if compensation is None else f"{row.state}, {compensation}"
