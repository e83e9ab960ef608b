"""Fault injection at every engine boundary, by code and by environment (recoverypoint.testing)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from rides import Faults, Provider, count, ride_operation

import recoverypoint as rp
from recoverypoint._faults import arm_from_environment
from recoverypoint.testing import FAULT_EXIT_STATUS, InjectedFault, faults


@pytest.fixture(autouse=True)
def no_faults_left() -> Iterator[None]:
    yield
    faults.disarm()


def point_of(db: sa.Engine, scope: str) -> str | None:
    with db.connect() as conn:
        return conn.execute(
            sa.text("SELECT recovery_point FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        ).scalar_one_or_none()


@pytest.mark.parametrize(
    ("point", "left_at", "charges_before_retry"),
    [
        ("before_commit:ride_created", None, 0),
        ("after_commit:ride_created", "ride_created", 0),
        ("before_foreign:charge_created", "ride_created", 0),
        ("after_foreign:charge_created", "ride_created", 1),
        ("before_commit:finished", "charge_created", 1),
        ("after_commit:finished", "finished", 1),
    ],
)
def test_each_boundary_fails_and_the_retry_completes_exactly_once(
    engine: rp.Engine,
    provider: Provider,
    db: sa.Engine,
    scope: str,
    point: str,
    left_at: str | None,
    charges_before_retry: int,
) -> None:
    op = ride_operation("create_ride", provider, Faults())
    engine.register(op)

    with faults.injected(point), pytest.raises(InjectedFault, match=point):
        engine.run(op, key="k", params={"scope": scope}, scope=scope)

    assert point_of(db, scope) == left_at
    charges = "SELECT count(*) FROM provider_charges WHERE scope = :s"
    assert count(db, charges, s=scope) == charges_before_retry
    outcome = engine.run(op, key="k", params={"scope": scope}, scope=scope)
    assert outcome.status == 201
    assert outcome.replayed == (left_at == "finished")
    assert count(db, charges, s=scope) == 1
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1


def test_wildcard_and_probability(engine: rp.Engine, provider: Provider, scope: str) -> None:
    op = ride_operation("create_ride", provider, Faults())
    engine.register(op)
    with faults.injected("before_foreign:*", probability=0.0):
        assert engine.run(op, key="never", params={"scope": scope}, scope=scope).status == 201
    with faults.injected("before_foreign:*"), pytest.raises(InjectedFault):
        engine.run(op, key="always", params={"scope": scope}, scope=scope)
    assert faults.fired["before_foreign:charge_created"] >= 1


def test_faults_are_off_by_default() -> None:
    assert faults.active is False


def test_armed_from_the_environment_a_registry_keeps_nothing_of_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a process forked from the demo's launcher re-arms: what the environment says,
    and no fault point or count of the process it was forked from."""
    registry = type(faults)()
    registry.arm("after_commit:x")
    with pytest.raises(InjectedFault):
        registry.hit("after_commit", "x")
    monkeypatch.setenv("RECOVERYPOINT_FAULTS", "before_commit:y=1")
    arm_from_environment(registry)
    registry.hit("after_commit", "x")  # disarmed: nothing happens
    with pytest.raises(InjectedFault):
        registry.hit("before_commit", "y")
    assert registry.fired == {"before_commit:y": 1}


@pytest.mark.parametrize(
    "spec",
    ["nowhere:x=0.5", "after_commit=0.5", "after_commit:x=2", "after_commit:x=often"],
)
def test_bad_specs_are_refused_clearly(spec: str) -> None:
    registry = type(faults)()
    with pytest.raises(ValueError, match="RECOVERYPOINT_FAULTS"):
        registry.configure(spec)


@pytest.mark.slow
def test_exit_effect_kills_the_process_and_a_retry_takes_over(
    engine: rp.Engine, provider: Provider, database_url: str, db: sa.Engine, scope: str
) -> None:
    """As SIGKILL would: the child dies after charging, holding the lease; once the lease
    expires a retry resumes, gets the same charge back and finishes."""
    env = {
        **os.environ,
        "RECOVERYPOINT_FAULTS": "after_foreign:charge_created=1",
        "RECOVERYPOINT_FAULT_EFFECT": "exit",
    }
    child = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("crash_child.py")), database_url, scope, "k"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == FAULT_EXIT_STATUS, child.stderr
    assert "injected fault after_foreign:charge_created" in child.stderr
    assert point_of(db, scope) == "ride_created"
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1

    op = ride_operation(
        "create_ride", provider, Faults(), lock_timeout=timedelta(seconds=1)
    )
    engine.register(op)
    with pytest.raises(rp.KeyInUse):  # the dead process's lease still holds
        engine.run(op, key="k", params={"scope": scope}, scope=scope)
    with db.begin() as conn:  # the lease expires
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET locked_at = now() - interval '1 hour' WHERE scope = :s"
            ),
            {"s": scope},
        )
    assert engine.run(op, key="k", params={"scope": scope}, scope=scope).status == 201
    assert count(db, "SELECT count(*) FROM provider_charges WHERE scope = :s", s=scope) == 1
    assert count(db, "SELECT count(*) FROM rides WHERE scope = :s", s=scope) == 1
