"""Real HTTP servers on loopback, each in a thread of the test process: uvicorn for ASGI
applications, werkzeug's threaded server for WSGI ones. Ports are picked by the kernel.
:data:`client` sends the tests' requests to them."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from werkzeug.serving import make_server

# One client for the tests' requests: httpx reads its CA bundle into a new SSL context for
# each client (about 20 ms of CPU, for plain HTTP too), and httpx.post() makes a client per
# call. Without keep-alive, each request still opens a connection of its own, as one of
# httpx.post() did.
client = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


@contextmanager
def serve_asgi(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn; yield its base URL; stop it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", ws="none", http="h11", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    # Only a server that never starts fails: on a busy machine one may take a while.
    deadline = time.monotonic() + 300
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def serve_wsgi(app: Any) -> Iterator[str]:
    """Serve ``app`` with werkzeug's threaded server; yield its base URL; stop it."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(30)
        server.server_close()
