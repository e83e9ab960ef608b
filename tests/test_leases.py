"""A request holds its key's lease in a foreign step that comes first, before any atomic
phase committed a point: another request with the key meanwhile gets KeyInUse, and the
foreign call happens once. (After a slow atomic phase: test_exactly_once.py.)"""

from __future__ import annotations

import inspect
import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recoverypoint as rp
from recoverypoint import leases
from recoverypoint.integrations.fastapi import Idempotency as FastAPIIdempotency
from recoverypoint.integrations.flask import Idempotency as FlaskIdempotency


def run_and_retry_meanwhile(
    engine: rp.Engine, op: rp.Operation[Any], in_step: threading.Event, leave_step: threading.Event
) -> tuple[Any, rp.KeyInUse]:
    """Run ``op`` in a thread; once it is in its foreign step, send the same request again;
    then let the first one go on. Returns the first one's outcome and the second's error."""
    first: list[Any] = []

    def run() -> None:
        try:
            first.append(engine.run(op, key="k", params={}))
        except Exception as exc:  # LockLost, when the second request took the key over
            first.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert in_step.wait(10)
        with pytest.raises(rp.KeyInUse) as in_use:
            engine.run(op, key="k", params={})
    finally:
        leave_step.set()
        thread.join(10)
    return first[0], in_use.value


def test_a_foreign_step_that_comes_first_holds_the_lease(worker_db: sa.Engine) -> None:
    op: rp.Operation[Any] = rp.Operation("foreign_first", lock_timeout=timedelta(seconds=30))
    in_step, leave_step = threading.Event(), threading.Event()
    calls: list[int] = []

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        calls.append(1)
        in_step.set()
        assert len(calls) > 1 or leave_step.wait(10)  # a second call does not wait
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    engine = rp.Engine(worker_db)
    engine.register(op)

    outcome, in_use = run_and_retry_meanwhile(engine, op, in_step, leave_step)

    assert outcome.status == 201
    assert 25 <= in_use.retry_after <= 30
    assert calls == [1]


# -- the rule's two halves agree ------------------------------------------------------------

# A lease held for :held seconds as the database's clock measures it, judged by the SQL half
# (free, seconds_left) and read as the engine reads it (HELD_FOR) for the Python half (left).
_JUDGED = sa.text(
    f"""
    SELECT {leases.free("CAST(:timeout AS double precision)")} AS free,
           {leases.seconds_left("CAST(:timeout AS double precision)")} AS seconds_left,
           {leases.HELD_FOR} AS held_for, now() AS now, k.locked_at
    FROM (SELECT CASE WHEN CAST(:held AS double precision) IS NOT NULL
                      THEN now() - make_interval(secs => CAST(:held AS double precision))
                 END AS locked_at) AS k
    """
)


def judged(db: sa.Engine, held: float | None, timeout: float) -> tuple[bool, float | None, int]:
    """Whether SQL finds the lease free, SQL's seconds left, and Python's; and checks that
    the deadline Python computes on the database's clock (free_before) agrees with SQL."""
    with db.connect() as conn:
        row = conn.execute(_JUDGED, {"held": held, "timeout": timeout}).one()
    deadline = leases.free_before(row.now, timeout)
    assert deadline is not None
    assert (row.locked_at is None or row.locked_at <= deadline) is row.free
    return row.free, row.seconds_left, leases.left(row.held_for, timeout)


@pytest.mark.parametrize("timeout", [90.0, 0.5, 3600.25])
@pytest.mark.parametrize(
    ("held_for", "free"),
    [
        (lambda t: 0.0, False),
        (lambda t: t - 0.001, False),
        (lambda t: t, True),
        (lambda t: t + 0.001, True),
    ],
    ids=["0", "timeout - 1 ms", "timeout", "timeout + 1 ms"],
)
def test_sql_and_python_judge_a_lease_alike_at_its_boundary(
    db: sa.Engine, timeout: float, held_for: Any, free: bool
) -> None:
    sql_free, seconds_left, python_left = judged(db, held_for(timeout), timeout)
    assert sql_free is free
    assert (python_left == 0) is free
    assert seconds_left is not None and (seconds_left <= 0) is free
    if not free:  # Retry-After: whole seconds, never less than what is left
        assert python_left >= seconds_left > python_left - 1


def test_a_lease_nobody_holds_is_free_on_both_sides(db: sa.Engine) -> None:
    assert judged(db, None, 90.0) == (True, None, 0)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    timeout_ms=st.integers(1, int(leases.MAX_LOCK_TIMEOUT.total_seconds() * 1000)),
    offset_ms=st.integers(-5_000, 5_000),
)
def test_sql_and_python_agree_on_any_lease(db: sa.Engine, timeout_ms: int, offset_ms: int) -> None:
    held_ms = max(0, timeout_ms + offset_ms)
    sql_free, _, python_left = judged(db, held_ms / 1000, timeout_ms / 1000)
    assert sql_free is (held_ms >= timeout_ms)
    assert (python_left == 0) is sql_free


def test_the_default_lock_timeout_is_the_one_everyone_declares() -> None:
    assert rp.Operation("defaults").lock_timeout == leases.DEFAULT_LOCK_TIMEOUT
    for declared in (rp.idempotent, FastAPIIdempotency.single_step, FlaskIdempotency.single_step):
        default = inspect.signature(declared).parameters["lock_timeout"].default
        assert default is leases.DEFAULT_LOCK_TIMEOUT, declared
