"""Exit statuses of the ``recoverypoint`` command, its one-line error messages, and how its
process ends (:func:`program`).

=====  =========================================================================
0      done
1      failed: the database is unreachable, a worker crashed, an invariant broke, a
       single worker pass (``--once``) left keys or jobs no running worker can finish
2      usage: bad arguments, a bulk action without ``--yes``, a bad ``--app``
3      not found: no such key or job
4      refused: the action does not apply to the key as it is (a live lease without
       ``--force``, a finished key to retry) or it changed meanwhile; nothing was done
130    interrupted (SIGINT)
141    stdout was closed by its reader (``| head``); the output was cut short
=====  =========================================================================
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

# 2 is argparse's own status for a usage error; 130 and 141 are the shells' 128 + SIGINT
# and 128 + SIGPIPE.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_BROKEN_PIPE = 3, 4, 141


def fail(command: str, status: int, message: str) -> int:
    """Print ``message`` as the error of ``recoverypoint <command>``, on one line of its
    own on stderr; return ``status``. What no encoding can write (an argument's bytes that
    were not UTF-8) is written as escapes."""
    line = f"{' '.join(['recoverypoint', *command.split()])}: error: {' '.join(message.split())}"
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)
    return status


def program(main: Callable[[], int]) -> int:
    """Run ``main`` as a process's program, which ends when it returns (or raises): the
    objects left are then left out of the exit's garbage collections, which walk every
    object the imports made (nearly a quarter of a short command's CPU). What they would
    find is garbage in reference cycles, whose finalizers Python does not promise to run at
    exit anyway: recoverypoint closes what it opens (its engines, files and pipes), and so
    must an application's code that a command runs (``worker --app``)."""
    try:
        return main()
    finally:
        gc.freeze()
