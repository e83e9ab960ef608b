"""The sync engine's statements on libpq (recoverypoint._libpq): values of any shape reach
the server intact, and a request interrupted while a pipeline waits for its results
leaves no half-written key, no broken connection in the pool, and one effect after a retry.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recoverypoint as rp
from recoverypoint import _libpq, sql

# Any text PostgreSQL can store: no NUL, no lone surrogate.
stored_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))

ECHO = sql.Statement(
    "SELECT %(s)s::text, array_to_json(%(a)s::text[])::text, %(i)s::bigint::text,"
    " %(f)s::float8::text, %(u)s::uuid::text, %(n)s::text IS NULL"
)


@pytest.fixture
def pooled(db: sa.Engine) -> Iterator[Any]:
    connection = db.raw_connection()
    connection.driver_connection.autocommit = True  # type: ignore[union-attr]
    try:
        yield connection
    finally:
        connection.driver_connection.autocommit = False  # type: ignore[union-attr]
        connection.close()


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=stored_text,
    items=st.lists(st.one_of(st.none(), stored_text), max_size=5),
    number=st.integers(-(2**63), 2**63 - 1),
    real=st.floats(allow_nan=False, allow_infinity=False),
)
def test_values_reach_the_server_as_they_were(
    pooled: Any, text: str, items: list[str | None], number: int, real: float
) -> None:
    token = uuid.uuid4()
    params = {"s": text, "a": items, "i": number, "f": real, "u": token, "n": None}
    row = _libpq.execute(pooled, pooled.driver_connection, ECHO, params)
    assert row is not None
    assert row[0] == text
    assert json.loads(row[1] or "null") == items
    assert int(row[2] or "") == number
    assert float(row[3] or "") == real
    assert row[4] == str(token)
    assert row[5] == "t"


def test_a_statement_someone_deallocated_is_prepared_again(pooled: Any) -> None:
    connection = pooled.driver_connection
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())
    connection.execute("DEALLOCATE ALL")
    with pytest.raises(Exception, match="does not exist"):
        _libpq.execute(pooled, connection, ECHO, _echo_params())
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())


def test_a_statement_already_prepared_is_used_as_it_is(pooled: Any) -> None:
    connection = pooled.driver_connection
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())
    pooled.info.clear()  # as after a failure that made it forget, with the statement kept
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())


def _echo_params() -> dict[str, Any]:
    return {"s": "s", "a": [], "i": 1, "f": 1.0, "u": uuid.uuid4(), "n": None}


def ride(scope: str) -> rp.Operation[Any]:
    # A short lease: an interrupt after COMMIT went out leaves the commit's fate unknown
    # to the client, and the lease held until it expires, as a crash would.
    op: rp.Operation[Any] = rp.Operation(
        f"libpq_{uuid.uuid4().hex[:8]}", lock_timeout=timedelta(seconds=1)
    )

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'created', %s)",
            (scope, tx.key_id),
        )

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'finished', %s)",
            (scope, tx.key_id),
        )
        tx.stage_job("receipt", {"charge": tx.state["charge"]})
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


def retried(request: Callable[[], rp.Outcome]) -> rp.Outcome:
    """``request`` again after each KeyInUse, as a client honouring Retry-After does."""
    for _ in range(5):
        try:
            return request()
        except rp.KeyInUse as busy:
            time.sleep(busy.retry_after or 1)
    return request()


def count(db: sa.Engine, query: str, **params: Any) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(query), params).scalar_one())


# A fresh key waits for libpq's results 15 times: in each of its three pipelines (BEGIN with
# the claim, the first point with COMMIT, the last with COMMIT), for each command's result,
# for the None that ends it, and for the sync. One past the last interrupts nothing.
WAITS = range(1, 17)


@pytest.mark.parametrize("interrupted_at", WAITS)
def test_an_interrupt_while_a_pipeline_waits_leaves_one_effect_after_a_retry(
    engine: rp.Engine,
    db: sa.Engine,
    scope: str,
    monkeypatch: pytest.MonkeyPatch,
    interrupted_at: int,
) -> None:
    op = ride(scope)
    engine.register(op)
    waits = {"n": 0}
    real_next_result = _libpq._next_result

    def interrupting(pgconn: Any) -> Any:
        waits["n"] += 1
        if waits["n"] == interrupted_at:
            raise KeyboardInterrupt
        return real_next_result(pgconn)

    monkeypatch.setattr(_libpq, "_next_result", interrupting)
    try:
        engine.run(op, key="k", params={}, scope=scope)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    monkeypatch.setattr(_libpq, "_next_result", real_next_result)
    assert interrupted == (interrupted_at <= 15)

    # No connection is left checked out, and none the pool hands out is broken.
    assert engine.db.pool.checkedout() == 0  # type: ignore[attr-defined]
    outcome = retried(lambda: engine.run(op, key="k", params={}, scope=scope))
    assert outcome.status == 201
    assert engine.run(op, key="k", params={}, scope=scope).replayed
    audits = "SELECT count(*) FROM audit_records WHERE scope = :s AND action = :a"
    assert count(db, audits, s=scope, a="created") == 1
    assert count(db, audits, s=scope, a="finished") == 1
    jobs = "SELECT count(*) FROM staged_jobs j JOIN idempotency_keys k"
    jobs += " ON k.id = j.idempotency_key_id WHERE k.scope = :s"
    assert count(db, jobs, s=scope) == 1
