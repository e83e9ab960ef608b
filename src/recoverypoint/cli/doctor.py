"""``recoverypoint doctor``: is the database ready, and is anything piling up?"""

from __future__ import annotations

import argparse

from .. import admin
from ..exits import EXIT_FAILED, EXIT_OK
from ._common import Subparsers, add_database_options, add_stuck_after, admin_for, guarded
from ._output import print_json, print_table


def add_doctor(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check the database, the schema, the clock, autovacuum, jobs and keys",
        description=(
            "Each check prints ok, warn (works; look at it) or fail (recoverypoint cannot "
            "work as it is) with what to do next. Exits 1 if any check fails."
        ),
    )
    add_database_options(parser)
    add_stuck_after(parser)
    parser.set_defaults(handler=guarded("doctor", _doctor))


def _doctor(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        checks = admin.diagnose(ops)
    if args.json:
        print_json(checks)
    else:
        print_table(
            ("check", "status", "detail", "what to do"),
            [(c.name, c.status, c.detail, c.hint or None) for c in checks],
        )
    return EXIT_FAILED if any(c.status == "fail" for c in checks) else EXIT_OK
