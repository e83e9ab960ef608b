"""Loopback ports for servers the tests start by port number (PostgreSQL, PgBouncer, the
tutorial's uvicorn), where a listening socket cannot be handed over instead.

A port the kernel picks with ``bind(("127.0.0.1", 0))`` is an ephemeral one, and the
suite's thousands of outgoing connections draw their local ports from that same range: one
of them can take the port between the asking and the server's ``bind`` ("address already
in use"). So ports come from outside the ephemeral range, each pytest-xdist worker from a
share of its own, starting at a random place in it (another run on the same machine starts
elsewhere), and one is handed out only if it binds at the moment of asking.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

_FIRST = 20000  # below: the well-known and registered ports services listen on


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


@functools.cache
def _share() -> list[int]:
    low, high = _ephemeral()
    outside = [*range(_FIRST, low), *range(max(high + 1, _FIRST), 65536)]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % workers if worker.isdigit() else 0
    size = len(outside) // workers
    if size < 20:
        raise RuntimeError(
            f"the ephemeral port range {low}-{high} leaves too few ports for {workers} "
            "workers: narrow it (net.ipv4.ip_local_port_range) or run fewer (-n)"
        )
    return outside[index * size : (index + 1) * size]


@functools.cache
def _candidates() -> Iterator[int]:
    share = _share()
    start = random.randrange(len(share))
    return itertools.cycle(share[start:] + share[:start])


def free_port() -> int:
    """A loopback port nothing holds at the moment of asking, that no other worker of this
    run and no outgoing connection is handed."""
    candidates = _candidates()
    for _ in range(len(_share())):
        port = next(candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"every port of this worker's {len(_share())} is taken")
