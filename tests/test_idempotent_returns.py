"""What ``@rp.idempotent`` functions return, thrown at it on a real database: whatever the
function returns, it runs once per key. A value its annotation describes comes back
exactly, on the first call and on every replay (bytes that are not UTF-8, text with NUL,
NaN and the infinities included); a value that cannot be stored is the key's answer, an
:class:`~recoverypoint.AbandonedCall` on every call, and the function never runs again; a
function that can never have its result stored is refused when it is decorated."""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, field_serializer

import recoverypoint as rp

T = TypeVar("T")


@dataclass
class Blob:
    name: str
    data: bytes
    ratio: float


class Signed(BaseModel):
    payload: bytes  # the model's own config dumps bytes as UTF-8


class Money(BaseModel):
    amount: Decimal
    when: datetime
    tags: frozenset[str]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def key_row(db: sa.Engine, operation: str, key: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT recovery_point, response_status, locked_at, attempts "
                "FROM idempotency_keys WHERE operation = :o AND idempotency_key = :k"
            ),
            {"o": operation, "k": key},
        ).one()


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to itself (a set's repr may list its items in another order)."""
    return type(a) is type(b) and (a == b or repr(a) == repr(b))


class Returning:
    """A decorated function that returns ``value`` and counts its runs, per key."""

    def __init__(self, engine: rp.Engine, annotation: Any) -> None:
        self.value: object = None
        self.runs: dict[str, int] = {}
        self.name = unique("returns")

        def returns(key: str) -> Any:
            self.runs[key] = self.runs.get(key, 0) + 1
            return self.value

        returns.__annotations__ = {"key": str, "return": annotation}
        self.call: Callable[[str], Any] = rp.idempotent(engine, key="key", name=self.name)(returns)

    def three_calls(self, key: str) -> list[object]:
        """What three calls with ``key`` return, an AbandonedCall as itself."""
        results: list[object] = []
        for _ in range(3):
            try:
                results.append(self.call(key))
            except rp.AbandonedCall as exc:
                results.append(exc)
        return results


def test_a_digest_returned_as_bytes_is_stored_and_the_function_runs_once(
    engine: rp.Engine, db: sa.Engine
) -> None:
    """The issue's case: a SHA-256 digest is not UTF-8; three calls used to run it three
    times, each raising TypeError."""
    f = Returning(engine, bytes)
    f.value = hashlib.sha256(b"order-7").digest()
    assert f.three_calls("k") == [f.value] * 3
    assert f.runs == {"k": 1}
    assert key_row(db, f.name, "k")[:2] == ("finished", 200)


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (str, "before\x00after"),
        (float, math.inf),
        (float, -math.inf),
        (list[float], [1.5, math.nan]),
        (Blob, Blob("b", bytes(range(256)), math.nan)),
        (dict[str, bytes], {"a": b"\xff\xfe", "b": b""}),
        (tuple[str, bytes], ("\x00", b"\x80")),
        (Money, Money(amount=Decimal("-1.10"), when=datetime(2026, 1, 1), tags=frozenset("ab"))),
    ],
)
def test_a_value_plain_json_cannot_carry_comes_back_exactly(
    engine: rp.Engine, db: sa.Engine, annotation: Any, value: object
) -> None:
    f = Returning(engine, annotation)
    f.value = value
    results = f.three_calls("k")
    assert all(same(result, value) for result in results), results
    assert f.runs == {"k": 1}


@pytest.mark.parametrize(
    ("annotation", "value", "why"),
    [
        (str, "lone \ud800 surrogate", "surrogate"),
        (Signed, Signed(payload=b"\xff"), "utf-8"),
        (int, "not an int", "int"),
        (Any, object(), "object"),
        (list[int], [1, "two"], "int"),
    ],
)
def test_a_value_that_cannot_be_stored_is_the_keys_answer_and_never_runs_again(
    engine: rp.Engine, db: sa.Engine, annotation: Any, value: object, why: str
) -> None:
    f = Returning(engine, annotation)
    f.value = value
    results = f.three_calls("k")
    assert all(isinstance(r, rp.AbandonedCall) for r in results), results
    assert "will not run again for this key" in str(results[0])
    assert f.runs == {"k": 1}
    row = key_row(db, f.name, "k")
    assert (row.recovery_point, row.response_status, row.locked_at) == ("finished", 500, None)


def test_a_generator_function_is_refused_when_decorated(engine: rp.Engine) -> None:
    def generates(key: str) -> Iterator[int]:
        yield 1

    async def generates_async(key: str) -> AsyncIterator[int]:
        yield 1

    for fn in (generates, generates_async):
        with pytest.raises(TypeError, match="generator function"):
            rp.idempotent(engine, key="key", name=unique("gen"))(fn)

    def iterates(key: str) -> Iterator[int]:
        return iter(())

    with pytest.raises(TypeError, match="cannot store as JSON"):
        rp.idempotent(engine, key="key", name=unique("iter"))(iterates)


def test_an_async_function_returning_bytes_runs_once(database_url: str, db: sa.Engine) -> None:
    name, runs = unique("async_digest"), []
    digest = hashlib.sha256(b"x").digest()

    async def main() -> list[bytes]:
        engine = rp.AsyncEngine(database_url)

        @rp.idempotent(engine, key="key", name=name)
        async def digest_of(key: str) -> bytes:
            runs.append(key)
            return digest

        try:
            return [await digest_of("k") for _ in range(3)]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [digest] * 3
    assert runs == ["k"]


# -- hypothesis: every shape a return annotation describes -----------------------------------

_text = st.text(alphabet=st.characters(codec=None), max_size=12)  # NUL and surrogates too
_floats = st.floats(allow_nan=True, allow_infinity=True)


def _nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=3) | st.dictionaries(
        st.text(max_size=4), children, max_size=3
    )


_shapes: list[tuple[Any, st.SearchStrategy[Any]]] = [
    (bytes, st.binary(max_size=64)),
    (str, _text),
    (float, _floats),
    (int, st.integers(min_value=-(10**40), max_value=10**40)),
    (Decimal, st.decimals(allow_nan=False, allow_infinity=False, places=4)),
    (datetime, st.datetimes(timezones=st.none() | st.just(timezone.utc))),
    (date, st.dates()),
    (set[int], st.sets(st.integers(), max_size=8)),
    (frozenset[str], st.frozensets(st.text(max_size=5), max_size=5)),
    (list[float], st.lists(_floats, max_size=8)),
    (dict[str, bytes], st.dictionaries(st.text(max_size=5), st.binary(max_size=8), max_size=5)),
    (tuple[int, str], st.tuples(st.integers(), _text)),
    (Blob, st.builds(Blob, _text, st.binary(max_size=16), _floats)),
    (int | None, st.none() | st.integers()),
    (None, st.none()),
    (Any, st.recursive(st.none() | st.booleans() | _floats | _text, _nested, max_leaves=20)),
]
_SHAPE = st.sampled_from(range(len(_shapes)))


def _has_surrogate(value: object) -> bool:
    text = repr(value)
    return any("\ud800" <= c <= "\udfff" for c in text) or "\\ud" in text


RETURNS = settings(
    database=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def returning(engine: rp.Engine) -> list[Returning]:
    return [Returning(engine, annotation) for annotation, _ in _shapes]


@RETURNS
@given(data=st.data())
@pytest.mark.slow
def test_whatever_a_function_returns_it_runs_once_per_key(
    returning: list[Returning], data: st.DataObject
) -> None:
    index = data.draw(_SHAPE, label="shape")
    annotation, values = _shapes[index]
    f = returning[index]
    f.value = value = data.draw(values, label="value")
    key = uuid.uuid4().hex
    results = f.three_calls(key)
    assert f.runs[key] == 1
    if all(isinstance(r, rp.AbandonedCall) for r in results):
        # Only what JSON text cannot carry at all: a lone surrogate (jsonb, and JSON
        # parsers, refuse one).
        assert _has_surrogate(value), (annotation, value, results[0])
        return
    for result in results:
        assert not isinstance(result, rp.AbandonedCall), result
        if annotation is Any:
            continue  # stored as its JSON (bytes as base64...), rebuilt as that JSON
        assert same(result, value), (annotation, value, result)


def test_a_value_nested_past_what_can_be_stored_runs_once_and_is_the_keys_answer(
    engine: rp.Engine,
) -> None:
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    f = Returning(engine, Any)
    f.value = deep
    results = f.three_calls("k")
    assert all(isinstance(r, rp.AbandonedCall) for r in results)
    assert f.runs == {"k": 1}


def test_a_large_value_comes_back_whole(engine: rp.Engine) -> None:
    f = Returning(engine, bytes)
    f.value = bytes(range(256)) * 8192  # 2 MiB, not UTF-8
    assert f.three_calls("k") == [f.value] * 3
    assert f.runs == {"k": 1}


def test_a_method_runs_once_per_key_for_any_instance(engine: rp.Engine) -> None:
    name = unique("method")

    class Shop:
        charges = 0

        @rp.idempotent(engine, key="order", name=name, exclude=("self",))
        def charge(self, order: str) -> bytes:
            Shop.charges += 1
            return hashlib.sha256(order.encode()).digest()

    first, second = Shop().charge("o-1"), Shop().charge("o-1")
    assert first == second == hashlib.sha256(b"o-1").digest()
    assert Shop.charges == 1


class Lossy(BaseModel):
    """A model whose own serializer writes what its validation refuses."""

    amount: int

    @field_serializer("amount")
    def as_words(self, amount: int) -> str:
        return f"{amount} units"


def test_a_value_that_does_not_read_back_is_refused_before_it_is_stored(
    engine: rp.Engine, db: sa.Engine
) -> None:
    f = Returning(engine, Lossy)
    f.value = Lossy(amount=3)
    results = f.three_calls("k")
    assert all(isinstance(r, rp.AbandonedCall) for r in results), results
    assert f.runs == {"k": 1}


def test_nan_where_the_annotation_is_any_comes_back_as_nan(engine: rp.Engine) -> None:
    """pydantic dumps a NaN it meets under Any as null: it must not be stored as one."""
    f = Returning(engine, Any)
    f.value = [1.5, math.nan, {"x": -math.inf}]
    results = f.three_calls("k")
    assert all(repr(r) == repr(f.value) for r in results), results


def _nested_in_lists(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


class Reading(BaseModel):
    value: Any


@pytest.mark.parametrize(
    "value",
    [
        1.0727769301088266e17,
        [1e16, {"x": -2.5e20}, 9999999999999998.0],
        Reading(value=[1.0727769301088266e17]),
        _nested_in_lists(1e17, 70),  # deeper than params may nest: a return value may
        -0.0,
        {"x": [-0.0]},
    ],
)
def test_a_float_jsonb_would_change_comes_back_as_it_went(engine: rp.Engine, value: object) -> None:
    """jsonb prints a float of 1e16 or more without its exponent: read back as JSON, an
    int, and for 1.0727769301088266e17 not even an equal one (107277693010882660). It
    stores -0.0 as 0."""
    f = Returning(engine, Reading if isinstance(value, Reading) else Any)
    f.value = value
    results = f.three_calls("k")
    assert all(repr(r) == repr(value) for r in results), results


def test_arguments_holding_nan_or_a_bool_key_are_refused_and_store_nothing(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name, runs = unique("nan_args"), []

    @rp.idempotent(engine, key="key", name=name)
    def takes(key: Any, data: Any) -> None:
        runs.append(key)

    with pytest.raises(rp.InvalidParams, match="NaN"):
        takes("k", [1.0, math.nan])
    with pytest.raises(rp.InvalidKey, match="str or an int, got bool"):
        takes(True, [])
    assert runs == []
    with db.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT count(*) FROM idempotency_keys WHERE operation = :o"), {"o": name}
        ).scalar()
    assert stored == 0


def test_the_functions_own_serialisation_error_propagates_as_it_is(engine: rp.Engine) -> None:
    """Not taken for arguments that cannot be stored: the function raised it."""
    from pydantic_core import PydanticSerializationError

    runs: list[int] = []

    @rp.idempotent(engine, key="key", name=unique("own_error"))
    def dumps(key: str) -> None:
        runs.append(1)
        TypeAdapter(Any).dump_python(object(), mode="json")  # a bug of its own

    with pytest.raises(PydanticSerializationError):
        dumps("k")
    assert runs == [1]
