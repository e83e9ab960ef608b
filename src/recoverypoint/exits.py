"""Exit statuses of the ``recoverypoint`` command, and its one-line error messages."""

from __future__ import annotations

import sys

# 2 is argparse's own status for a usage error; 130 is the shells' 128 + SIGINT.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def fail(command: str, status: int, message: str) -> int:
    """Print ``message`` as the error of ``recoverypoint <command>``; return ``status``."""
    print(f"recoverypoint {command}: error: {message}", file=sys.stderr)
    return status
