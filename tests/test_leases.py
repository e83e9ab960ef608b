"""A request holds its key's lease in a foreign step that comes first, before any atomic
phase committed a point: another request with the key meanwhile gets KeyInUse, and the
foreign call happens once. (After a slow atomic phase: test_exactly_once.py.)"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

import recoverypoint as rp


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
