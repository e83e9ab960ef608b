"""Clients booking rides through the retrying client, printing what happened to each.

Every fifth ride is booked by ``declined@example.com``, whose card the provider declines.
Each request is one logical request: one ``Idempotency-Key``, reused on every retry. At
the end the first ride is sent again with its key, to show the replay.

The exit status is 0 when every request got a final answer (201 or 402), 1 otherwise.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter, defaultdict
from typing import Any

import httpx

from recoverypoint.client import AsyncClient, Retry, RetryPolicy

from .schema import USERS

POLICY = RetryPolicy(max_attempts=8, base_delay=0.2, max_delay=5.0, total_timeout=60.0)
EXPECTED = {201, 402}


def ride_body(rng: random.Random) -> dict[str, float]:
    """A ride across San Francisco."""
    return {
        "origin_lat": round(rng.uniform(37.70, 37.80), 6),
        "origin_lon": round(rng.uniform(-122.50, -122.39), 6),
        "target_lat": round(rng.uniform(37.70, 37.80), 6),
        "target_lon": round(rng.uniform(-122.50, -122.39), 6),
    }


async def simulate(api_url: str, requests: int, concurrency: int, seed: int | None = None) -> int:
    rng = random.Random(seed)
    emails = list(USERS)
    retries: dict[str, list[str]] = defaultdict(list)
    outcomes: Counter[str] = Counter()
    first: tuple[str, str, dict[str, Any]] | None = None

    def on_retry(retry: Retry) -> None:
        why = str(retry.status) if retry.status else type(retry.error).__name__
        retries[retry.key].append(why)

    async with AsyncClient(api_url, policy=POLICY, on_retry=on_retry, timeout=15.0) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for number in range(1, requests + 1):
            queue.put_nowait(number)

        async def book(number: int) -> None:
            nonlocal first
            email = emails[1] if number % 5 == 0 else emails[0]
            key, body = str(uuid.uuid4()), ride_body(rng)
            if first is None:
                first = (email, key, body)
            try:
                answer = await client.post(
                    "/rides", json=body, headers=_auth(email), idempotency_key=key
                )
            except httpx.TransportError as exc:
                result = f"gave up: {exc!r}"
                outcomes["gave up"] += 1
            else:
                result = f"{answer.status_code} {answer.text}"
                outcomes[str(answer.status_code)] += 1
            tries = retries[key]
            detail = f"after {len(tries)} retries ({', '.join(tries)})" if tries else "first try"
            print(f"ride {number:>3} {email:<21} {result}  [{detail}]", flush=True)

        async def worker() -> None:
            while not queue.empty():
                await book(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        total_retries = sum(len(r) for r in retries.values())
        summary = ", ".join(f"{n} x {outcome}" for outcome, n in sorted(outcomes.items()))
        print(f"{requests} requests: {summary}; {total_retries} retries", flush=True)

        if first is not None:
            email, key, body = first
            again = await client.post(
                "/rides", json=body, headers=_auth(email), idempotency_key=key
            )
            replayed = again.headers.get("Idempotent-Replayed", "false")
            print(
                f"ride   1 sent again with its key: {again.status_code} {again.text}  "
                f"[Idempotent-Replayed: {replayed}]",
                flush=True,
            )
    failed = sum(n for outcome, n in outcomes.items() if outcome not in map(str, EXPECTED))
    return 1 if failed else 0


def _auth(email: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {email}"}
