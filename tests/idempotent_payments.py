"""A fake payment API for the ``@idempotent`` tests, served over real HTTP on loopback.

``POST /charges`` with ``Idempotency-Key`` charges once per key, as Stripe does: a key it
has seen returns the first charge. Every request is counted, so a test sees how often the
function body really called out. ``?delay=`` makes a charge slow; ``?fail=1`` makes it a 500
before anything is charged.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from http_servers import serve_asgi
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class Payments:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()  # requests per idempotency key
        self.charges: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.app = Starlette(routes=[Route("/charges", self.charge, methods=["POST"])])

    async def charge(self, request: Request) -> JSONResponse:
        key = request.headers.get("idempotency-key", "")
        body = await request.json()
        with self._lock:
            self.calls[key] += 1
        delay = float(request.query_params.get("delay", "0"))
        if delay:
            await asyncio.sleep(delay)
        if request.query_params.get("fail"):
            return JSONResponse({"error": "payments API down"}, status_code=500)
        with self._lock:
            if key not in self.charges:
                charge_id = f"ch_{next(self._ids)}"
                self.charges[key] = {"id": charge_id, "amount": body["amount"]}
        return JSONResponse(self.charges[key])

    def total_calls(self) -> int:
        return sum(self.calls.values())


@contextmanager
def payments_api() -> Iterator[tuple[Payments, str]]:
    payments = Payments()
    with serve_asgi(payments.app) as url:
        yield payments, url
