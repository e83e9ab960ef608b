"""``@rp.idempotent`` on sync functions, on a real database, against a payment API served
over HTTP on loopback (``idempotent_payments``): every effect is counted where it lands."""

from __future__ import annotations

import contextvars
import inspect
import json
import math
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from idempotent_payments import Payments, payments_api
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.idempotent.shape import Shape


class Receipt(BaseModel):
    charge_id: str
    amount: int
    order_id: str


@dataclass
class Card:
    number: str
    holder: str


@pytest.fixture(scope="module")
def payments() -> Iterator[tuple[Payments, str]]:
    with payments_api() as api:
        yield api


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def charge_at(url: str, amount: int, *, fail: bool = False, delay: float = 0) -> dict[str, Any]:
    query = {"fail": "1"} if fail else {}
    if delay:
        query["delay"] = str(delay)
    response = httpx.post(
        f"{url}/charges",
        params=query,
        json={"amount": amount},
        headers={"Idempotency-Key": rp.downstream_key()},
        timeout=10,
    )
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def key_rows(db: sa.Engine, operation: str) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT scope, idempotency_key, recovery_point, attempts, locked_at, "
                    "response_status, response_body FROM idempotency_keys WHERE operation = :o "
                    "ORDER BY id"
                ),
                {"o": operation},
            )
        )


def test_a_key_from_an_argument_runs_once_and_replays_the_stored_model(
    engine: rp.Engine, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    api, url = payments
    name = unique("charge_order")

    @rp.idempotent(engine, key="order_id", name=name)
    def charge_order(order_id: str, amount: int) -> Receipt:
        charge = charge_at(url, amount)
        return Receipt(charge_id=charge["id"], amount=amount, order_id=order_id)

    first = charge_order("o-1", 2000)
    again = charge_order(order_id="o-1", amount=2000)  # same call, spelt otherwise
    assert isinstance(first, Receipt) and isinstance(again, Receipt)
    assert first == again
    [row] = key_rows(db, name)
    assert (row.idempotency_key, row.recovery_point, row.response_status) == (
        "o-1",
        "finished",
        200,
    )
    assert row.response_body == first.model_dump()
    [downstream] = [k for k, c in api.charges.items() if c["id"] == first.charge_id]
    assert api.calls[downstream] == 1  # the body ran once


def test_a_lost_key_row_hands_the_payment_api_the_same_downstream_key(
    engine: rp.Engine, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    # A failover to a lagging standby loses the key row of a call that charged: the call
    # made again runs the body again, which must hand the API the key it handed it before,
    # so that the API returns the charge it made instead of charging again.
    api, url = payments
    name = unique("charge_order")

    @rp.idempotent(engine, key="order_id", name=name)
    def charge_order(order_id: str, amount: int) -> Receipt:
        charge = charge_at(url, amount)
        return Receipt(charge_id=charge["id"], amount=amount, order_id=order_id)

    first = charge_order("o-1", 2000)
    with db.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE operation = :o"), {"o": name})
    again = charge_order("o-1", 2000)
    assert again == first
    [downstream] = [k for k, c in api.charges.items() if c["id"] == first.charge_id]
    assert api.calls[downstream] == 2  # the body ran again, with the same key


def test_a_key_from_a_callable_and_a_scope_from_an_argument(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name = unique("notify")
    ran: list[str] = []

    @rp.idempotent(
        engine, key=lambda a: f"notify:{a['user_id']}:{a['template']}", scope="tenant", name=name
    )
    def notify(tenant: str, user_id: int, template: str = "welcome") -> dict[str, Any]:
        ran.append(template)
        return {"sent": template, "to": user_id}

    assert notify("acme", 7) == {"sent": "welcome", "to": 7}
    assert notify("acme", 7, "welcome") == {"sent": "welcome", "to": 7}
    assert notify("globex", 7) == {"sent": "welcome", "to": 7}  # another scope: another key
    assert notify("acme", 7, template="reset") == {"sent": "reset", "to": 7}
    assert ran == ["welcome", "welcome", "reset"]
    rows = key_rows(db, name)
    assert [(r.scope, r.idempotency_key) for r in rows] == [
        ("acme", "notify:7:welcome"),
        ("globex", "notify:7:welcome"),
        ("acme", "notify:7:reset"),
    ]


def test_the_first_call_returns_what_every_replay_returns(engine: rp.Engine) -> None:
    @rp.idempotent(engine, key="key", name=unique("shapes"))
    def shapes(key: str) -> Any:
        return {"pair": (1, 2), "b": 1.5}

    @rp.idempotent(engine, key="key", name=unique("typed"))
    def typed(key: str) -> tuple[int, Card]:
        return (3, Card("4242", "Ada"))

    assert shapes("k") == shapes("k") == {"b": 1.5, "pair": [1, 2]}
    assert typed("k") == typed("k") == (3, Card("4242", "Ada"))


def test_the_same_key_with_other_arguments_is_a_params_mismatch(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name = unique("refund")
    ran: list[int] = []

    @rp.idempotent(engine, key="refund_id", name=name)
    def refund(refund_id: str, amount: int, card: Card) -> int:
        ran.append(amount)
        return amount

    card = Card("4242", "Ada")
    assert refund("r-1", 500, card) == 500
    with pytest.raises(rp.ParamsMismatch) as caught:
        refund("r-1", 600, card)
    message = str(caught.value)
    assert ".refund with other arguments" in message
    assert "method" not in message and "path" not in message and "\n" not in message
    with pytest.raises(rp.ParamsMismatch):
        refund("r-1", 500, Card("4242", "Bob"))
    assert refund("r-1", 500, Card("4242", "Ada")) == 500  # equal arguments: a replay
    assert ran == [500]
    assert len(key_rows(db, name)) == 1


def _bound_as_the_signature_does(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return TypeError
    bound.apply_defaults()
    return list(bound.arguments.items())


def _by_shape(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return list(Shape(fn, ()).bind(args, kwargs).items())
    except TypeError:
        return TypeError


def _plain(a: int, b: str = "b", c: float = 1.5) -> None: ...
def _positional_only(a: int, /, b: int = 2) -> None: ...
def _keyword_only(a: int, *, b: int = 2) -> None: ...
def _starred(a: int, *rest: int, **named: int) -> None: ...


@settings(max_examples=200, deadline=None)
@given(
    fn=st.sampled_from([_plain, _positional_only, _keyword_only, _starred]),
    values=st.lists(st.integers(), max_size=5),
    by_name=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(), max_size=3),
)
def test_a_call_binds_its_arguments_as_python_does_however_they_are_passed(
    fn: Callable[..., Any], values: list[int], by_name: dict[str, int]
) -> None:
    # The arguments by name, defaults applied, in the signature's order; or the TypeError
    # the function itself would raise: the same whether a call takes the shortcut for
    # arguments passed by position or not (break the shortcut's length check, and this
    # fails).
    assert _by_shape(fn, tuple(values), by_name) == _bound_as_the_signature_does(
        fn, tuple(values), by_name
    )
    assert _by_shape(fn, tuple(values), {}) == _bound_as_the_signature_does(fn, tuple(values), {})


def test_concurrent_calls_in_threads_run_the_body_once(
    engine: rp.Engine, payments: tuple[Payments, str]
) -> None:
    api, url = payments
    order = unique("order")
    start = threading.Barrier(8)

    @rp.idempotent(engine, key="order_id", name=unique("slow_charge"))
    def slow_charge(order_id: str) -> str:
        return str(charge_at(url, 100, delay=0.3)["id"])

    def call() -> str:
        start.wait()
        try:
            return slow_charge(order)
        except rp.KeyInUse as exc:
            assert exc.retry_after >= 1
            return "in use"

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: call(), range(8)))
    winners = [r for r in results if r != "in use"]
    assert len(winners) == 1 and results.count("in use") == 7
    assert slow_charge(order) == winners[0]  # then a replay
    [downstream] = [k for k, c in api.charges.items() if c["id"] == winners[0]]
    assert api.calls[downstream] == 1


def test_a_failure_propagates_and_the_retry_runs_again_with_the_same_downstream_key(
    engine: rp.Engine, db: sa.Engine, payments: tuple[Payments, str]
) -> None:
    api, url = payments
    name = unique("flaky")
    seen: list[str] = []
    fail = [True, True, False]

    @rp.idempotent(engine, key="order_id", name=name)
    def flaky(order_id: str) -> str:
        seen.append(rp.downstream_key())
        return str(charge_at(url, 300, fail=fail.pop(0))["id"])

    for _ in range(2):
        with pytest.raises(httpx.HTTPStatusError):
            flaky("o-9")
    [row] = key_rows(db, name)
    assert (row.recovery_point, row.attempts, row.locked_at, row.response_status) == (
        "started",
        2,
        None,
        None,
    )
    charge_id = flaky("o-9")
    assert flaky("o-9") == charge_id
    assert len(seen) == 3 and len(set(seen)) == 1  # one downstream key for every attempt
    assert api.calls[seen[0]] == 3 and api.charges[seen[0]]["id"] == charge_id


def test_an_abandoned_key_raises_abandoned_call_and_never_runs_the_function_again(
    engine: rp.Engine, db: sa.Engine
) -> None:
    from recoverypoint import admin

    name = unique("abandoned")
    runs: list[str] = []

    @rp.idempotent(engine, key="order_id", name=name)
    def doomed(order_id: str) -> str:
        runs.append(order_id)
        raise RuntimeError("the provider is down")

    with pytest.raises(RuntimeError):
        doomed("o-1")
    with db.connect() as conn:
        key_id = conn.execute(
            sa.text("SELECT id FROM idempotency_keys WHERE operation = :o"), {"o": name}
        ).scalar_one()
    result = admin.abandon(admin.Admin.for_engine(engine), key_id, message="given up by support")
    assert result.changed == (key_id,)

    for _ in range(2):
        with pytest.raises(rp.AbandonedCall, match="given up by support"):
            doomed("o-1")
    assert runs == ["o-1"]  # the abandoned key's function never ran again
    with pytest.raises(RuntimeError):  # a new key runs it
        doomed("o-2")
    assert runs == ["o-1", "o-2"]


def test_downstream_keys_differ_by_key_and_name_and_only_exist_inside(engine: rp.Engine) -> None:
    @rp.idempotent(engine, key="k", name=unique("keys"))
    def keys(k: str) -> list[str]:
        return [rp.downstream_key(), rp.downstream_key("refund"), rp.downstream_key()]

    a, b = keys("a"), keys("b")
    assert a[0] == a[2] != a[1] and len(set(a + b)) == 4
    with pytest.raises(RuntimeError, match="only inside a function decorated with @idempotent"):
        rp.downstream_key()


def test_the_function_sees_its_callers_context_variables(engine: rp.Engine) -> None:
    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant")

    @rp.idempotent(engine, key="k", name=unique("context"))
    def whose(k: str) -> str:
        return tenant.get()

    tenant.set("acme")
    assert whose("k") == "acme"


def test_excluded_arguments_are_neither_stored_nor_fingerprinted(
    engine: rp.Engine, db: sa.Engine
) -> None:
    name = unique("with_client")

    class Client:  # not JSON
        pass

    @rp.idempotent(engine, key="k", name=name, exclude=("client",))
    def with_client(client: Client, k: str) -> str:
        return k

    assert with_client(Client(), "x") == with_client(Client(), "x") == "x"
    with db.connect() as conn:
        params = conn.execute(
            sa.text("SELECT request_params FROM idempotency_keys WHERE operation = :o"), {"o": name}
        ).scalar_one()
    assert params == {"k": "x"}


def test_declaration_mistakes_are_type_errors_at_decoration(engine: rp.Engine) -> None:
    async def coroutine(k: str) -> None: ...

    with pytest.raises(TypeError, match=r"an async function, which needs rp\.AsyncEngine"):
        rp.idempotent(engine, key="k")(coroutine)

    def plain(k: str) -> None: ...

    with pytest.raises(TypeError, match="has no argument 'order_id' to take the key from"):
        rp.idempotent(engine, key="order_id", name=unique("n"))(plain)
    with pytest.raises(TypeError, match="has no argument 'client' to exclude"):
        rp.idempotent(engine, key="k", exclude=("client",), name=unique("n"))(plain)

    def unstorable(k: str, lock: threading.Lock) -> None: ...

    with pytest.raises(TypeError, match=r"leave it out with exclude=\('lock',\)"):
        rp.idempotent(engine, key="k", name=unique("n"))(unstorable)


def test_a_key_that_is_not_text_or_an_int_is_invalid(engine: rp.Engine, db: sa.Engine) -> None:
    name = unique("bad_key")

    @rp.idempotent(engine, key="k", name=name)
    def f(k: Any) -> None: ...

    for bad in (None, 1.5, b"x", "", "é", "x" * 256):
        with pytest.raises(rp.InvalidKey):
            f(bad)
    f(42)
    assert [r.idempotency_key for r in key_rows(db, name)] == ["42"]


def test_a_return_value_that_cannot_be_stored_finishes_the_key_and_never_runs_again(
    engine: rp.Engine, db: sa.Engine
) -> None:
    """The function ran, its effect happened: the refusal is the key's answer, and no
    later call runs it again (it used to run once per call)."""
    name = unique("returns_object")
    ran: list[int] = []

    @rp.idempotent(engine, key="k", name=name)
    def returns_object(k: str) -> Any:
        ran.append(1)
        return object() if len(ran) == 1 else "fine"

    for _ in range(3):
        with pytest.raises(rp.AbandonedCall, match="returned a value that cannot be stored"):
            returns_object("k")
    [row] = key_rows(db, name)
    assert (row.recovery_point, row.response_status, row.locked_at) == ("finished", 500, None)
    assert ran == [1]


# -- hostile arguments -----------------------------------------------------------------------

HOSTILE = settings(
    database=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_leaf = st.one_of(
    st.text(alphabet=st.characters(codec=None), max_size=20),  # surrogates and NUL included
    st.sampled_from(["\x00", "\ud800", "a\udfffb", "\u202e", "\ufeff", "💥" * 3]),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
)
_json_ish = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
_hostile = st.one_of(
    _json_ish,
    st.integers(min_value=1, max_value=300).map(lambda d: _nested(d)),  # past the depth limit
    st.sampled_from([10**5000, "x" * 2_000_000, object(), {1, 2}, b"\x00"]),
)


def _non_finite_inside(value: Any) -> bool:
    """Whether a NaN or an infinity is anywhere in ``value``, by the definition, recursively."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(map(_non_finite_inside, value.values()))
    return isinstance(value, list | tuple) and any(map(_non_finite_inside, value))


_with_floats = st.recursive(
    st.sampled_from([math.nan, math.inf, -math.inf])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e16, -1e16, 1.0727769301088266e17, 9999999999999998.0, 1e-7, -0.0])
    | st.integers(min_value=-1000, max_value=1000)
    | st.text(alphabet="ab", max_size=3),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet="ab", max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@HOSTILE
@given(value=_with_floats)
@pytest.mark.slow
def test_a_nan_or_an_infinity_anywhere_in_the_arguments_is_refused_every_other_float_kept(
    hostile_function: tuple[Any, str, list[Any]], value: Any
) -> None:
    # JSON cannot carry them, and pydantic would dump one under Any as null: another value.
    # jsonb prints 1e16 and more without the exponent (the value form would give an int)
    # and stores -0.0 as 0.
    store_it, _, ran = hostile_function
    before = len(ran)
    if _non_finite_inside(value):
        with pytest.raises(rp.InvalidParams, match="NaN or an infinity"):
            store_it(uuid.uuid4().hex, value)
        assert len(ran) == before
    else:  # and every other float comes back as it went, a float of the same value
        as_text = json.dumps(value, sort_keys=True)
        assert json.dumps(store_it(uuid.uuid4().hex, value), sort_keys=True) == as_text


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(scope="module")
def hostile_function(db: sa.Engine) -> tuple[Any, str, list[Any]]:
    engine = rp.Engine(db)
    name = unique("hostile")
    ran: list[Any] = []

    @rp.idempotent(engine, key="key", name=name)
    def store_it(key: str, value: Any) -> Any:
        ran.append(value)
        return value

    return store_it, name, ran


@HOSTILE
@given(value=_hostile)
@pytest.mark.slow
def test_hostile_arguments_are_stored_whole_or_refused_clearly_leaving_nothing(
    hostile_function: tuple[Any, str, list[Any]], db: sa.Engine, value: Any
) -> None:
    store_it, name, ran = hostile_function
    key = uuid.uuid4().hex
    before = len(ran)
    try:
        first = store_it(key, value)
    except (rp.InvalidParams, rp.RequestTooLarge) as exc:
        assert exc.message and "Traceback" not in exc.message
        assert len(ran) == before  # the function never ran
        with db.connect() as conn:
            stored = conn.execute(
                sa.text(
                    "SELECT count(*) FROM idempotency_keys WHERE operation = :o AND "
                    "idempotency_key = :k"
                ),
                {"o": name, "k": key},
            ).scalar_one()
        assert stored == 0
        return
    # Accepted: the whole call is stored and replays as it answered.
    assert len(ran) == before + 1
    assert store_it(key, value) == first
    assert len(ran) == before + 1
    [row] = [r for r in key_rows(db, name) if r.idempotency_key == key]
    assert (row.recovery_point, row.response_status, row.locked_at) == ("finished", 200, None)
