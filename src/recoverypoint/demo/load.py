"""The demo's load: rides booked by concurrent clients through the retrying client, and
what each client saw."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..client import AsyncClient, Retry, RetryPolicy
from ..integrations import IDEMPOTENT_REPLAYED

# Bounded on purpose: a client gives up after a few attempts or 15 seconds, and the
# completer must finish what it left.
POLICY = RetryPolicy(max_attempts=5, base_delay=0.1, max_delay=2.0, total_timeout=15.0)
FINAL = (201, 402)
"""A ride booked, or a card declined: answers a client does not retry."""


@dataclass
class Sent:
    """One logical request and the last thing its client saw."""

    key: str
    email: str
    status: int | None = None
    """The last answer's status; ``None`` when the last attempt got no answer."""
    replayed: bool = False
    body: Any = None


@dataclass
class LoadResult:
    sent: list[Sent] = field(default_factory=list)
    retries: int = 0
    conflicts: int = 0
    """409 answers, retried or final."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Load:
    """``requests`` rides from ``concurrency`` clients; ``users`` are (email, declined)
    pairs, and every fifth ride is booked by a user whose card is declined.

    ``on_done(done, result)`` is called after each request; ``midway``, if given, runs
    once in a thread of its own when half the requests are done (e.g. a database restart).
    """

    api_url: str
    requests: int
    concurrency: int
    users: tuple[tuple[str, bool], ...]
    seed: int
    on_done: Callable[[int, LoadResult], None] = lambda done, result: None
    midway: Callable[[], None] | None = None

    def run(self) -> LoadResult:
        return asyncio.run(self._run())

    async def _run(self) -> LoadResult:
        rng = random.Random(self.seed)
        paying = [email for email, declined in self.users if not declined]
        declined = [email for email, declined in self.users if declined]
        result = LoadResult()
        for number in range(1, self.requests + 1):
            pool = declined if declined and number % 5 == 0 else paying
            key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            result.sent.append(Sent(key, rng.choice(pool)))
        bodies = [_ride(rng) for _ in result.sent]

        def on_retry(retry: Retry) -> None:
            result.retries += 1
            result.conflicts += retry.status == 409

        queue = iter(range(self.requests))
        done = 0
        began = time.monotonic()
        midway: list[threading.Thread] = []
        async with AsyncClient(self.api_url, policy=POLICY, on_retry=on_retry, timeout=10.0) as c:

            async def client() -> None:
                nonlocal done
                for index in queue:
                    await _book(c, result.sent[index], bodies[index])
                    result.conflicts += result.sent[index].status == 409
                    done += 1
                    if self.midway is not None and not midway and done >= self.requests / 2:
                        midway.append(threading.Thread(target=self.midway, name="midway"))
                        midway[0].start()
                    self.on_done(done, result)

            await asyncio.gather(*(client() for _ in range(self.concurrency)))
        for thread in midway:
            await asyncio.to_thread(thread.join)
        result.seconds = time.monotonic() - began
        return result


async def _book(client: AsyncClient, sent: Sent, body: dict[str, float]) -> None:
    try:
        answer = await client.post(
            "/rides",
            json=body,
            headers={"Authorization": f"Bearer {sent.email}"},
            idempotency_key=sent.key,
        )
    except httpx.TransportError:
        return  # gave up with no answer: the status stays None
    sent.status = answer.status_code
    sent.replayed = answer.headers.get(IDEMPOTENT_REPLAYED) == "true"
    try:
        sent.body = answer.json()
    except ValueError:
        sent.body = answer.text


def _ride(rng: random.Random) -> dict[str, float]:
    """A ride across San Francisco."""
    return {
        name: round(rng.uniform(low, high), 6)
        for name, low, high in (
            ("origin_lat", 37.70, 37.80),
            ("origin_lon", -122.50, -122.39),
            ("target_lat", 37.70, 37.80),
            ("target_lon", -122.50, -122.39),
        )
    }
