"""recoverypoint.testing.Clock: time moved forward without sleeping, judged as production
judges it (the database's clock). Each rule about time runs out once the clock moves past
it, and not before: a lease, a finished key's retention, a failed key's back-off."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint.testing import Clock
from recoverypoint.workers import Completer

LEASE = timedelta(seconds=90)


def counted(name: str, calls: list[str], *, fail: list[bool] | None = None) -> rp.Operation[Any]:
    """An operation whose last phase counts its runs; it fails while ``fail`` holds True.
    (The first phase commits with the claim, so a failure leaves the key behind.)"""
    op: rp.Operation[Any] = rp.Operation(name, lock_timeout=LEASE)

    @op.atomic_phase("begun")
    def begin(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        if fail and fail[0]:
            raise RuntimeError("the phase failed")
        calls.append(name)
        return rp.Response(201, {"n": len(calls)})

    return op


def hold_lease(db: sa.Engine, key: str) -> None:
    """Leave the key's lease held, as a process that died holding it would."""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET locked_at = now(), lock_token = gen_random_uuid() "
                "WHERE idempotency_key = :key"
            ),
            {"key": key},
        )


def test_a_dead_holders_lease_runs_out_when_the_clock_passes_it(worker_db: sa.Engine) -> None:
    calls: list[str] = []
    fail = [True]
    op = counted("leased", calls, fail=fail)
    engine, clock = rp.Engine(worker_db), Clock(worker_db)
    engine.register(op)
    with pytest.raises(RuntimeError):
        engine.run(op, key="k", params={})
    hold_lease(worker_db, "k")
    fail[0] = False
    with pytest.raises(rp.KeyInUse):
        engine.run(op, key="k", params={})
    clock.advance(LEASE - timedelta(seconds=5))
    with pytest.raises(rp.KeyInUse):
        engine.run(op, key="k", params={})
    clock.advance(seconds=5)
    assert engine.run(op, key="k", params={}).status == 201
    assert calls == ["leased"] and clock.moved == LEASE


def test_72_hours_later_a_finished_key_is_a_new_request(worker_db: sa.Engine) -> None:
    calls: list[str] = []
    op = counted("kept", calls)
    engine = rp.Engine(worker_db)
    clock = Clock(engine)
    engine.register(op)
    assert engine.run(op, key="k", params={}).body == {"n": 1}
    clock.advance(hours=71)
    assert engine.run(op, key="k", params={}).replayed
    clock.advance(hours=1)
    again = engine.run(op, key="k", params={})
    assert not again.replayed and again.body == {"n": 2}
    assert calls == ["kept", "kept"]


def test_a_failed_key_is_due_once_its_back_off_has_passed(worker_db: sa.Engine) -> None:
    calls: list[str] = []
    fail = [True]
    op = counted("backed_off", calls, fail=fail)
    engine = rp.Engine(worker_db, retry_base=600, retry_cap=600)
    engine.register(op)
    with pytest.raises(RuntimeError):
        engine.run(op, key="k", params={})
    fail[0] = False
    completer = Completer(engine, min_age=0)
    assert completer.run_once().backing_off == 1 and calls == []
    Clock(worker_db).advance(seconds=600)
    assert completer.run_once().finished == 1 and calls == ["backed_off"]


def test_time_only_moves_forward(worker_db: sa.Engine) -> None:
    clock = Clock(worker_db)
    with pytest.raises(ValueError, match="forward"):
        clock.advance(timedelta(seconds=-1))
    with pytest.raises(TypeError):
        clock.advance(timedelta(seconds=1), hours=1)
    with pytest.raises(TypeError):
        clock.advance()
    assert clock.moved == timedelta(0)
