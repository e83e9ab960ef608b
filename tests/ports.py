"""Loopback ports for servers the tests start by port number (PostgreSQL, PgBouncer, the
tutorial's uvicorn), where a listening socket cannot be handed over instead.

A port the kernel picks with ``bind(("127.0.0.1", 0))`` is an ephemeral one, and the
suite's thousands of outgoing connections draw their local ports from that same range: one
of them can take the port between the asking and the server's ``bind`` ("address already
in use"). So ports come from below the ephemeral range, each pytest-xdist worker from a
block of its own, and one is handed out only if it binds at the moment of asking.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

_BLOCK = 500  # ports per worker: more than any worker's servers in one run


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    first = 20000 + _BLOCK * index
    if first + _BLOCK > _ephemeral_floor():
        raise RuntimeError(f"no ports below the ephemeral range for xdist worker {index}")
    return range(first, first + _BLOCK)


_candidates = itertools.cycle(_block())


def free_port() -> int:
    """A loopback port nothing holds at the moment of asking, that no other worker of this
    run and no outgoing connection is handed."""
    for _ in range(_BLOCK):
        port = next(_candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"every port of {_block()} is taken")
