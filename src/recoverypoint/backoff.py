"""Exponential backoff with jitter, shared by in-process retries and per-key scheduling.

Written once in Python (:func:`backoff_delay`) and once in SQL (:func:`delay_sql`, for the
claims, which schedule a key's next attempt from the attempts the row has counted);
tests/test_backoff.py checks that the two agree.
"""

from __future__ import annotations

import random
from typing import Any


def backoff_delay(attempt: int, *, base: float, cap: float, jitter: float | None = None) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0).

    Half the exponential delay is fixed and half is random ("equal jitter"): retries of
    many requests that failed together spread out, yet none retries almost at once.
    ``jitter``: where in the random half, from 0 to 1; drawn here when not given.
    """
    if jitter is None:
        jitter = random.random()
    delay = min(cap, base * 2.0 ** min(attempt, 62))
    return delay / 2 + delay / 2 * jitter


def delay_sql(attempt: str) -> str:
    """SQL: :func:`backoff_delay` in seconds for ``attempt`` (an SQL expression), with the
    bind parameters of :func:`sql_params`. The jitter is drawn in Python: Citus refuses a
    VOLATILE function such as random() in an UPDATE."""
    delay = (
        "least(%(retry_cap)s::float8, "
        f"%(retry_base)s::float8 * power(2.0::float8, least({attempt}, 62)))"
    )
    return f"({delay} / 2 + {delay} / 2 * %(jitter)s::float8)"


def sql_params(*, base: float, cap: float) -> dict[str, Any]:
    """The bind parameters of :func:`delay_sql`, with a jitter of their own."""
    return {"retry_base": base, "retry_cap": cap, "jitter": random.random()}
