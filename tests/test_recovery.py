"""Resume after a failure at every phase boundary: no committed phase runs twice, the
foreign system sees one downstream key and charges once."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from rides import Boom, Faults, Provider, count, ride_operation

import recoverypoint as rp

RIDES = rp.Request("POST", "/rides")

# fault point → (recovery point left behind, or None when no key survives;
#                executions of each phase body expected over both attempts)
BOUNDARIES: dict[str, tuple[str | None, dict[str, int]]] = {
    "ride_created:start": (None, {"ride_created:start": 2, "charge_created:before_call": 1}),
    "ride_created:before_commit": (
        None,
        {"ride_created:start": 2, "charge_created:before_call": 1},
    ),
    "charge_created:before_call": (
        "ride_created",
        {"ride_created:start": 1, "charge_created:before_call": 2, "finished:start": 1},
    ),
    "charge_created:after_call": (
        "ride_created",
        {"ride_created:start": 1, "charge_created:before_call": 2, "finished:start": 1},
    ),
    "finished:start": (
        "charge_created",
        {"ride_created:start": 1, "charge_created:before_call": 1, "finished:start": 2},
    ),
    "finished:before_commit": (
        "charge_created",
        {"ride_created:start": 1, "charge_created:before_call": 1, "finished:start": 2},
    ),
}


def stored(db: sa.Engine, scope: str) -> dict[str, Any] | None:
    with db.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT recovery_point, locked_at, attempts, last_error "
                "FROM idempotency_keys WHERE scope = :s"
            ),
            {"s": scope},
        ).one_or_none()
    return None if row is None else dict(row._mapping)


@pytest.mark.parametrize("fault", list(BOUNDARIES))
@pytest.mark.slow
def test_resume_after_failure_at_every_boundary(
    engine: rp.Engine,
    provider: Provider,
    faults: Faults,
    db: sa.Engine,
    scope: str,
    fault: str,
) -> None:
    left_at, executions = BOUNDARIES[fault]
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)
    faults.armed.add(fault)

    with pytest.raises(Boom):
        engine.run(op, key="k", params={"scope": scope}, scope=scope, request=RIDES)

    row = stored(db, scope)
    if left_at is None:
        assert row is None  # a new key that failed its first phase leaves nothing behind
    else:
        assert row is not None
        assert row["recovery_point"] == left_at
        assert row["locked_at"] is None  # the lease was released
        assert row["attempts"] == 1
        assert row["last_error"] == f"Boom: {fault}"

    outcome = engine.run(op, key="k", params={"scope": scope}, scope=scope, request=RIDES)

    assert outcome.status == 201 and not outcome.replayed
    for point, times in executions.items():
        assert faults.calls[point] == times, point
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    assert len(set(provider.keys_seen)) == 1  # one downstream key, however many calls
    assert (
        count(
            db,
            "SELECT count(*) FROM rides r JOIN provider_charges c ON c.id = r.charge_id "
            "WHERE r.scope = :s",
            s=scope,
        )
        == 1
    )
    assert (
        count(
            db,
            "SELECT count(*) FROM staged_jobs j JOIN idempotency_keys k "
            "ON k.id = j.idempotency_key_id WHERE k.scope = :s",
            s=scope,
        )
        == 1
    )


@pytest.mark.slow
def test_retryable_releases_the_lease_keeps_the_point_and_schedules_a_retry(
    engine: rp.Engine, provider: Provider, faults: Faults, db: sa.Engine, scope: str
) -> None:
    op = ride_operation("create_ride", provider, faults)
    engine.register(op)

    def provider_unavailable() -> None:
        raise rp.Retryable("provider unavailable")

    faults.hooks["charge_created:before_call"] = provider_unavailable

    with pytest.raises(rp.Retryable) as caught:
        engine.run(op, key="k", params={"scope": scope}, scope=scope, request=RIDES)

    assert caught.value.http_status == 503
    with db.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT recovery_point, locked_at, lock_token, attempts, last_error, "
                "next_attempt_at > now() AS scheduled FROM idempotency_keys WHERE scope = :s"
            ),
            {"s": scope},
        ).one()
    assert row.recovery_point == "ride_created"
    assert row.locked_at is None and row.lock_token is None
    assert row.attempts == 1
    assert row.last_error == "Retryable: provider unavailable"
    assert row.scheduled

    del faults.hooks["charge_created:before_call"]
    outcome = engine.run(op, key="k", params={"scope": scope}, scope=scope, request=RIDES)
    assert outcome.status == 201
