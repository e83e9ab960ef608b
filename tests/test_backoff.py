"""The backoff every retry shares: exponential, capped, half of it jittered."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from recoverypoint.backoff import backoff_delay


@given(
    attempt=st.integers(min_value=0, max_value=10_000),
    base=st.floats(min_value=0.001, max_value=100),
    cap=st.floats(min_value=0.001, max_value=86_400),
)
def test_the_delay_doubles_up_to_the_cap_and_half_of_it_is_jitter(
    attempt: int, base: float, cap: float
) -> None:
    full = min(cap, base * 2.0 ** min(attempt, 62))
    delay = backoff_delay(attempt, base=base, cap=cap)
    assert full / 2 <= delay <= full <= cap


def test_the_delays_of_one_attempt_differ() -> None:
    delays = {backoff_delay(3, base=1.0, cap=60.0) for _ in range(20)}
    assert len(delays) == 20
    assert all(4.0 <= delay <= 8.0 for delay in delays)
