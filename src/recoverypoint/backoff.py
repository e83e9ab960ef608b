"""Exponential backoff with jitter, shared by in-process retries and per-key scheduling."""

from __future__ import annotations

import random


def backoff_delay(attempt: int, *, base: float, cap: float) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0).

    Half the exponential delay is fixed and half is random ("equal jitter"): retries of
    many requests that failed together spread out, yet none retries almost at once.
    """
    delay = min(cap, base * 2.0 ** min(attempt, 62))
    return delay / 2 + random.uniform(0, delay / 2)
