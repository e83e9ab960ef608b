"""The backoff every retry shares: exponential, capped, half of it jittered; in Python and
in the claims' SQL alike."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recoverypoint.backoff import backoff_delay, delay_sql, sql_params


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


@given(
    attempt=st.integers(min_value=0, max_value=200),
    jitter=st.floats(min_value=0, max_value=1),
)
@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_claims_sql_schedules_as_python_does(
    db: sa.Engine, attempt: int, jitter: float
) -> None:
    """The claims schedule a key's next attempt in SQL (backoff.delay_sql): the same delay
    as backoff_delay's, for the same jitter."""
    params = {**sql_params(base=2.0, cap=3600.0), "jitter": jitter, "attempt": attempt}
    with db.connect() as conn:
        in_sql = conn.exec_driver_sql(f"SELECT {delay_sql('%(attempt)s::int')}", params).scalar()
    expected = backoff_delay(attempt, base=2.0, cap=3600.0, jitter=jitter)
    assert in_sql == pytest.approx(expected, rel=1e-12)
