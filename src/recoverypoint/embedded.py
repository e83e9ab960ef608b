"""An embedded PostgreSQL (the ``pgserver`` package) for examples and tests without a server."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .database import normalize_url


class EmbeddedServer:
    """A running embedded server: its :attr:`url`, and :meth:`restart` to crash it."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.url: str = normalize_url(server.get_uri()).render_as_string(hide_password=False)

    def restart(self, downtime: float = 1.0) -> None:
        """Stop the server as a crash would, wait ``downtime`` seconds, start it again.

        SIGQUIT is PostgreSQL's immediate shutdown: every backend exits at once, open
        transactions are lost and the next start runs crash recovery. Clients see their
        connections drop, then refused, then the server back at the same address.
        """
        pid = self._server.get_pid()
        os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(downtime)
        # Starts it again with the same data directory and socket, and records the new
        # postmaster so that stopping the server at the end stops this one.
        self._server.ensure_postgres_running()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def embedded_server() -> Iterator[EmbeddedServer]:
    """Start a throwaway PostgreSQL in a temporary directory; yield it; stop it.

    Needs the ``embedded`` extra: ``pip install 'recoverypoint[embedded]'``.
    """
    try:
        with warnings.catch_warnings():
            # pgserver warns on import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as exc:
        raise RuntimeError(
            "no database URL was given and the embedded server is not installed: "
            "pip install 'recoverypoint[embedded]', or pass a PostgreSQL URL"
        ) from exc
    with tempfile.TemporaryDirectory(prefix="recoverypoint-pg-") as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")  # type: ignore[attr-defined]
        try:
            yield EmbeddedServer(server)
        finally:
            server.cleanup()


@contextmanager
def embedded_database() -> Iterator[str]:
    """Start a throwaway PostgreSQL in a temporary directory; yield its URL; stop it."""
    with embedded_server() as server:
        yield server.url
