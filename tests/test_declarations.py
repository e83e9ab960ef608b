"""Declaration mistakes raise when the operation is declared or registered, not per request.

These need no database: an engine is only built, never connected.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import recoverypoint as rp


def noop(ctx: Any, params: Any) -> None:
    return None


@pytest.fixture
def engine() -> rp.Engine:
    return rp.Engine("postgresql://nobody@127.0.0.1:1/never_connected")


def test_operation_without_phases(engine: rp.Engine) -> None:
    with pytest.raises(rp.DeclarationError, match="at least one phase"):
        engine.register(rp.Operation("empty"))


def test_duplicate_recovery_point_raises_at_declaration() -> None:
    op: rp.Operation[Any] = rp.Operation("dup")
    op.atomic_phase("created")(noop)
    with pytest.raises(rp.DeclarationError, match="declared twice"):
        op.foreign_step("created")(noop)


@pytest.mark.parametrize("point", ["started", ""])
def test_reserved_or_empty_point(point: str) -> None:
    with pytest.raises(rp.DeclarationError):
        rp.Operation("reserved").atomic_phase(point)


def test_nothing_may_follow_finished() -> None:
    op: rp.Operation[Any] = rp.Operation("after_finish")
    op.atomic_phase("finished")(noop)
    with pytest.raises(rp.DeclarationError, match="finished"):
        op.atomic_phase("later")


def test_foreign_step_last(engine: rp.Engine) -> None:
    op: rp.Operation[Any] = rp.Operation("dangling")
    op.atomic_phase("created")(noop)
    op.foreign_step("charged")(noop)
    with pytest.raises(rp.DeclarationError, match="foreign step"):
        engine.register(op)


@pytest.mark.parametrize("target", ["nowhere", "created", "first"])
def test_unknown_or_backward_jump_target(engine: rp.Engine, target: str) -> None:
    op: rp.Operation[Any] = rp.Operation("jumpy")
    op.atomic_phase("first")(noop)
    op.atomic_phase("created", jumps_to=(target,))(noop)
    op.atomic_phase("finished")(noop)
    with pytest.raises(rp.DeclarationError, match=target):
        engine.register(op)


def test_two_operations_under_one_name_and_version(engine: rp.Engine) -> None:
    first: rp.Operation[Any] = rp.Operation("twice")
    first.atomic_phase("finished")(noop)
    second: rp.Operation[Any] = rp.Operation("twice")
    second.atomic_phase("finished")(noop)
    engine.register(first)
    engine.register(first)  # the same object again is harmless
    with pytest.raises(rp.DeclarationError, match="already registered"):
        engine.register(second)


@pytest.mark.parametrize(
    "options",
    [{"version": 0}, {"max_attempts": 0}, {"lock_timeout": timedelta(0)}],
)
def test_bad_operation_options(options: dict[str, Any]) -> None:
    with pytest.raises(rp.DeclarationError):
        rp.Operation("bad", **options)


def test_non_postgres_url_is_refused() -> None:
    with pytest.raises(ValueError, match="PostgreSQL"):
        rp.Engine("sqlite:///x.db")


@pytest.mark.parametrize(
    "url",
    ["postgres://u@h/d", "postgresql://u@h/d", "postgresql+psycopg://u@h/d"],
)
def test_every_postgres_url_form_runs_on_psycopg3(url: str) -> None:
    assert rp.Engine(url).db.dialect.driver == "psycopg"


def test_an_engine_on_another_driver_is_refused_up_front() -> None:
    import sqlalchemy as sa

    with pytest.raises(ValueError, match="psycopg 3"):
        rp.Engine(sa.create_engine("sqlite://"))
