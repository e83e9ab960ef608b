"""Bad input raises a clear IdempotencyError subclass and leaves no row behind."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from rides import count

import recoverypoint as rp


class Amount(BaseModel):
    amount: int


@pytest.fixture
def ran() -> list[Any]:
    return []


@pytest.fixture
def op(engine: rp.Engine, ran: list[Any]) -> rp.Operation[Any]:
    operation: rp.Operation[Any] = rp.Operation("strict")

    @operation.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append(params)
        return rp.Response(200)

    engine.register(operation)
    return operation


def assert_nothing_stored(db: sa.Engine, scope: str, ran: list[Any]) -> None:
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0
    assert ran == []


@pytest.mark.parametrize(
    "key",
    ["", "k" * 256, "abc\x00def", "abc\ndef", "tab\tkey", "\x7f", "clé-unicode", None, 42],
    ids=["empty", "256-chars", "nul", "newline", "tab", "del", "non-ascii", "none", "int"],
)
def test_invalid_keys_get_400(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    ran: list[Any],
    key: Any,
) -> None:
    with pytest.raises(rp.InvalidKey) as caught:
        engine.run(op, key=key, params={}, scope=scope)
    assert caught.value.http_status == 400
    assert "idempotency key" in str(caught.value)
    assert_nothing_stored(db, scope, ran)


def test_longest_valid_key_is_accepted(
    engine: rp.Engine, op: rp.Operation[Any], scope: str, ran: list[Any]
) -> None:
    assert engine.run(op, key="k" * 255, params={}, scope=scope).status == 200
    assert len(ran) == 1


@pytest.mark.parametrize(
    "params",
    [
        {"when": object()},
        {"name": "nul\x00inside"},
        {"nul\x00key": 1},
        {"x": float("nan")},
        {"x": float("inf")},
        {1, 2},
    ],
    ids=["object", "nul-value", "nul-key", "nan", "inf", "set"],
)
def test_params_that_cannot_be_stored_get_422(
    engine: rp.Engine,
    op: rp.Operation[Any],
    db: sa.Engine,
    scope: str,
    ran: list[Any],
    params: Any,
) -> None:
    with pytest.raises(rp.InvalidParams) as caught:
        engine.run(op, key="k", params=params, scope=scope)
    assert caught.value.http_status == 422
    assert_nothing_stored(db, scope, ran)


def test_oversized_params_get_413(db: sa.Engine, scope: str, ran: list[Any]) -> None:
    engine = rp.Engine(db, max_params_bytes=1024)
    operation: rp.Operation[Any] = rp.Operation("small")

    @operation.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        ran.append(params)
        return rp.Response(200)

    engine.register(operation)
    with pytest.raises(rp.RequestTooLarge) as caught:
        engine.run(operation, key="k", params={"blob": "x" * 1100}, scope=scope)
    assert caught.value.http_status == 413
    assert_nothing_stored(db, scope, ran)
    assert engine.run(operation, key="k", params={"blob": "x" * 900}, scope=scope).status == 200


def test_params_failing_their_model_get_422(
    engine: rp.Engine, db: sa.Engine, scope: str, ran: list[Any]
) -> None:
    operation = rp.Operation("typed", params=Amount)

    @operation.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Amount) -> rp.Response:
        ran.append(params)
        return rp.Response(200)

    engine.register(operation)
    with pytest.raises(rp.InvalidParams, match="amount"):
        engine.run(operation, key="k", params={"amount": "lots"}, scope=scope)
    assert_nothing_stored(db, scope, ran)


@pytest.mark.parametrize("scope_value", ["s" * 256, "nul\x00scope", None])
def test_invalid_scope_is_a_programming_error(
    engine: rp.Engine, op: rp.Operation[Any], db: sa.Engine, ran: list[Any], scope_value: Any
) -> None:
    with pytest.raises(ValueError, match="scope"):
        engine.run(op, key="k", params={}, scope=scope_value)
    assert ran == []


def test_every_error_is_an_idempotency_error_with_a_status() -> None:
    expected = {
        rp.InvalidKey: 400,
        rp.InvalidParams: 422,
        rp.RequestTooLarge: 413,
        rp.ParamsMismatch: 422,
        rp.KeyInUse: 409,
        rp.LockLost: 409,
        rp.ConcurrentUpdate: 409,
        rp.Retryable: 503,
    }
    for cls, status in expected.items():
        error = cls()
        assert isinstance(error, rp.IdempotencyError)
        assert error.http_status == status
        assert str(error)  # the docstring is the default message
        # ... as one line, as a log or an HTTP answer shows it.
        assert str(error) == " ".join(str(error).split()), repr(str(error))
