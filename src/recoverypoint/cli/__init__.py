"""The ``recoverypoint`` command: one module per command family.

Each family adds its parser and sets ``handler``; a new one only needs to be added to
:data:`_COMMANDS`. Nothing imports this package: it sits on top of every other layer.

Every command behaves in a pipe: stdout carries the data (``--json`` for scripts),
stderr one line per error and the audit trail, and a reader that goes away early
(``| head -1``) ends the command quietly, with status 141 as for any tool SIGPIPE stops.
The exit statuses are listed in :mod:`recoverypoint.exits`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ..exits import EXIT_BROKEN_PIPE, EXIT_USAGE, fail, program
from ._common import Handler, Subparsers
from .console import add_console
from .demo import add_demo
from .doctor import add_doctor
from .explore import add_explore
from .jobs import add_jobs
from .keys import add_keys
from .metrics import add_metrics
from .migrate import add_migrate
from .worker import add_worker

_COMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    add_migrate,
    add_worker,
    add_keys,
    add_jobs,
    add_doctor,
    add_metrics,
    add_console,
    add_demo,
    add_explore,
)


class _Parser(argparse.ArgumentParser):
    """argparse's, with a usage error on one line, as every other error (``--help``
    shows the usage), and options taken only as spelled out: a prefix argparse would
    complete (``--f`` for ``--force``) is refused, so that no abbreviation in a script
    starts to mean another option when one is added. Its subcommands' parsers are of this
    class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        sys.exit(fail(self.prog.removeprefix("recoverypoint"), EXIT_USAGE, message))


def build_parser() -> argparse.ArgumentParser:
    """The ``recoverypoint`` command line, every subcommand included."""
    parser: argparse.ArgumentParser = _Parser(
        prog="recoverypoint",
        description="Idempotency keys with recovery points on PostgreSQL.",
    )
    # The version is pyproject.toml's, as installed: defined there alone.
    parser.add_argument(
        "--version",
        action="version",
        version=f"recoverypoint {importlib.metadata.version('recoverypoint')}",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add_command in _COMMANDS:
        add_command(subparsers)
    return parser


def entry() -> int:
    """The ``recoverypoint`` program, ``python -m recoverypoint`` as well: :func:`main` in
    a process of its own."""
    return program(main)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        status = handler(args)
        sys.stdout.flush()  # here, so a closed pipe is met inside the try
    except BrokenPipeError:
        # The reader has all it wanted. Point stdout at /dev/null so the interpreter's
        # own flush at exit does not fail again with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return status
