"""The sync engine's statements on libpq (recoverypoint.engine._libpq): values of any shape reach
the server intact, and a request interrupted while a pipeline waits for its results
leaves no half-written key, no broken connection in the pool, and one effect after a retry.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import PipelineStatus, Trace, TransactionStatus
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint import _pooler
from recoverypoint.database import create_engine
from recoverypoint.engine import _libpq, _pg, sql

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
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())
    connection.execute("DISCARD ALL")
    assert _libpq.execute(pooled, connection, ECHO, _echo_params(), begin="1")
    connection.rollback()


@pytest.fixture
def one_connection(database_url: str, business_tables: None) -> Iterator[rp.Engine]:
    engine = rp.Engine(create_engine(database_url, pool_size=1, max_overflow=0))
    yield engine
    engine.db.dispose()


def test_requests_go_on_after_the_application_deallocates_between_them(
    one_connection: rp.Engine, db: sa.Engine, scope: str
) -> None:
    """psycopg deallocates every prepared statement after a ROLLBACK it sends, once it
    prepared one of its own: an application's rolled-back transaction on the pool's
    connection takes the engine's statements with it."""
    engine = one_connection
    op = ride(scope)
    engine.register(op)
    assert engine.run(op, key="a", params={}, scope=scope).status == 201
    for _ in range(6):  # psycopg prepares a statement on its 5th run
        with engine.db.connect() as conn:
            conn.execute(sa.text("SELECT 1 WHERE 1 = :one"), {"one": 1})
            conn.rollback()
    assert engine.run(op, key="b", params={}, scope=scope).status == 201
    with engine.db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("DISCARD ALL")
    assert engine.run(op, key="a", params={}, scope=scope).replayed
    assert engine.run(op, key="c", params={}, scope=scope).status == 201


def test_a_phase_that_rolls_back_to_a_savepoint_commits(
    one_connection: rp.Engine, scope: str
) -> None:
    """Inside a phase: once psycopg prepared a statement, ROLLBACK TO SAVEPOINT makes it
    deallocate them all, and the engine prepares its own again before recording the phase."""
    engine = one_connection
    op: rp.Operation[Any] = rp.Operation(f"savepoint_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def undo_a_part(tx: rp.AtomicContext, params: Any) -> rp.Response:
        for _ in range(6):  # psycopg prepares a statement on its 5th run
            tx.execute("SELECT 1 WHERE 1 = %s", (1,))
        if params["undo"]:
            tx.execute("SAVEPOINT part")
            tx.execute("ROLLBACK TO SAVEPOINT part")
        return rp.Response(201)

    engine.register(op)
    # The first prepares the engine's statements on the pool's one connection.
    assert engine.run(op, key="warm", params={"undo": False}, scope=scope).status == 201
    for key in ("a", "b"):
        assert engine.run(op, key=key, params={"undo": True}, scope=scope).status == 201


def test_a_statement_already_prepared_is_used_as_it_is(pooled: Any) -> None:
    connection = pooled.driver_connection
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())
    pooled.info.clear()  # as after a failure that made it forget, with the statement kept
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())


def test_a_statement_forgotten_inside_a_transaction_keeps_it_going(pooled: Any) -> None:
    """A PREPARE of a name the session already holds would fail, and abort the transaction:
    the engine asks the server what it holds before it prepares anything."""
    connection = pooled.driver_connection
    assert _libpq.execute(pooled, connection, ECHO, _echo_params())
    _libpq.forget(pooled)
    assert _libpq.execute(pooled, connection, ECHO, _echo_params(), begin="1")
    _libpq.forget(pooled)
    assert _libpq.execute(pooled, connection, ECHO, _echo_params(), commit=True)
    assert connection.info.transaction_status == TransactionStatus.IDLE


def test_a_connection_on_a_high_file_descriptor_works(database_url: str) -> None:
    """A busy server has thousands of files open: select() cannot watch a descriptor past
    1023 (FD_SETSIZE), so the engine waits with poll()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files: no descriptor past 1023 can exist")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        db = create_engine(database_url, pool_size=1)
        pooled = db.raw_connection()
        try:
            connection = pooled.driver_connection
            assert connection.pgconn.socket > 1024
            assert _libpq.execute(pooled, connection, ECHO, _echo_params(), begin="1")
            connection.rollback()
        finally:
            pooled.close()
            db.dispose()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_text_value_with_a_nul_is_refused(pooled: Any) -> None:
    # libpq would cut it at the NUL; psycopg refuses it, and so does the engine.
    with pytest.raises(psycopg.DataError, match="NUL"):
        _libpq.execute(pooled, pooled.driver_connection, ECHO, {**_echo_params(), "s": "a\x00b"})
    with pytest.raises(psycopg.DataError, match="NUL"):
        _libpq.execute(pooled, pooled.driver_connection, ECHO, {**_echo_params(), "a": ["\x00"]})


def test_before_libpq_17_the_server_says_what_it_holds(
    pooled: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_libpq, "CLOSES", False)
    test_a_statement_forgotten_inside_a_transaction_keeps_it_going(pooled)


def shipping(scope: str, meanwhile: Callable[[rp.StepContext], None]) -> rp.Operation[Any]:
    """Three atomic phases around a foreign step that runs ``meanwhile``."""
    op: rp.Operation[Any] = rp.Operation(f"shipping_{uuid.uuid4().hex[:8]}")
    insert = "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, %s, %s)"

    @op.atomic_phase("created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute(insert, (scope, "created", tx.key_id))

    @op.foreign_step("charged")
    def charge(step: rp.StepContext, params: Any) -> None:
        meanwhile(step)

    @op.atomic_phase("shipped")
    def ship(tx: rp.AtomicContext, params: Any) -> None:
        cursor = tx.cursor()  # a cursor the engine does not watch
        for _ in range(6):  # psycopg prepares a statement on its 5th run
            cursor.execute("SELECT 1 WHERE 1 = %s", (1,))
        if params["savepoint"]:
            cursor.execute("SAVEPOINT part")
            cursor.execute("ROLLBACK TO SAVEPOINT part")
        tx.execute(insert, (scope, "shipped", tx.key_id))

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(insert, (scope, "finished", tx.key_id))
        return rp.Response(201)

    return op


@pytest.mark.parametrize("where", ["in a foreign step", "in a phase's own cursor"])
def test_statements_deallocated_behind_the_engine_cost_an_attempt_at_most(
    one_connection: rp.Engine, db: sa.Engine, scope: str, where: str
) -> None:
    """psycopg sends DEALLOCATE ALL after a ROLLBACK once it prepared a statement of its
    own: the application's, on the pool's connection while a foreign step runs, or a
    phase's on a cursor the engine does not watch. The transaction that finds the engine's
    statements gone runs again, and the request finishes with one of each effect."""
    engine = one_connection

    def application_work(step: rp.StepContext) -> None:
        if where != "in a foreign step":
            return
        with engine.db.begin() as conn:
            for _ in range(6):
                conn.execute(sa.text("SELECT 1 WHERE 1 = :one"), {"one": 1})
        with engine.db.connect() as conn:  # its close rolls back: DEALLOCATE ALL
            conn.execute(sa.text("SELECT 1"))

    op = shipping(scope, application_work)
    engine.register(op)
    params = {"savepoint": where == "in a phase's own cursor"}
    assert engine.run(op, key="warm", params={"savepoint": False}, scope=scope).status == 201
    assert engine.run(op, key="k", params=params, scope=scope).status == 201
    actions = "SELECT action, count(*) FROM audit_records WHERE scope = :s GROUP BY action"
    with db.connect() as conn:
        counted = {action: n for action, n in conn.execute(sa.text(actions), {"s": scope})}
    assert counted == {"created": 2, "shipped": 2, "finished": 2}


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


# A fresh key waits for libpq's results some 24 to 31 times (more when results come in
# pieces, on a busy machine): in each of its three pipelines (BEGIN and the transaction's
# token with the claim, the first point with COMMIT, the last with COMMIT), for each
# command's result, for the None that ends it, and for the sync. Each is interrupted in
# turn; one past the last interrupts nothing.
WAITS = range(1, 41)


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
    # The engine's statements prepared first: only the request's own waits are counted.
    engine.run(op, key="warm-up", params={}, scope=scope)
    waits = {"n": 0, "at": 0}
    real_next_result = _libpq.next_result

    def interrupting(pgconn: Any) -> Any:
        if pgconn.pipeline_status != PipelineStatus.OFF:  # not a statement being prepared
            waits["n"] += 1
            if waits["n"] == waits["at"]:
                raise KeyboardInterrupt
        return (yield from real_next_result(pgconn))

    monkeypatch.setattr(_libpq, "next_result", interrupting)
    waits["at"] = interrupted_at
    try:
        engine.run(op, key="k", params={}, scope=scope)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    monkeypatch.setattr(_libpq, "next_result", real_next_result)
    # The interrupt reaches the caller whenever it was raised, and every request waits
    # more than 20 times.
    assert interrupted == (waits["n"] >= interrupted_at)
    assert interrupted or interrupted_at > 20, waits["n"]

    # No connection is left checked out, and none the pool hands out is broken.
    assert engine.db.pool.checkedout() == 0  # type: ignore[attr-defined]
    outcome = retried(lambda: engine.run(op, key="k", params={}, scope=scope))
    assert outcome.status == 201
    assert engine.run(op, key="k", params={}, scope=scope).replayed
    audits = "SELECT count(*) FROM audit_records WHERE scope = :s AND action = :a"
    assert count(db, audits, s=scope, a="created") == 2  # the warm-up's and this key's
    assert count(db, audits, s=scope, a="finished") == 2
    jobs = "SELECT count(*) FROM staged_jobs j JOIN idempotency_keys k"
    jobs += " ON k.id = j.idempotency_key_id WHERE k.scope = :s"
    assert count(db, jobs, s=scope) == 2


def test_the_deallocation_check_keeps_short_statement_texts_only() -> None:
    # Phase code's statements are checked for words that make psycopg deallocate; the
    # answer is kept per text, but not for long texts (values written into them), which
    # would otherwise be kept once per request.
    tx = _pg.Transaction.__new__(_pg.Transaction)
    kept = _pg._deallocates_kept.cache_info().currsize
    for n in range(3):
        tx._deallocated = False
        tx.note(f"SELECT 1 -- {n} " + "x" * 5000)
        assert not tx._deallocated
    tx.note("DROP TABLE t -- " + "x" * 5000)
    assert tx._deallocated
    assert _pg._deallocates_kept.cache_info().currsize == kept
    tx._deallocated = False
    tx.note("SELECT 1 -- a short text")
    assert not tx._deallocated
    assert _pg._deallocates_kept.cache_info().currsize == kept + 1


def _prepared_on(db: sa.Engine) -> tuple[set[str], Any]:
    """The names prepared on one of ``db``'s pooled connections, and its prepare threshold."""
    with db.connect() as conn:
        names = set(conn.exec_driver_sql("SELECT name FROM pg_prepared_statements").scalars())
        threshold = conn.connection.driver_connection.prepare_threshold  # type: ignore[union-attr]
    return names, threshold


class Traced:
    """What the next connection a pool makes sends before the pool hands it out: its
    queries as libpq's trace shows them, listened for ahead of every other listener.
    A context: the listener and the trace's file go with it, whatever happened."""

    def __init__(self, pool_events: Any) -> None:
        self.pool_events = pool_events
        self.file = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by __exit__

    def __enter__(self) -> Traced:
        sa.event.listen(self.pool_events, "connect", self._trace, insert=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sa.event.remove(self.pool_events, "connect", self._trace)
        self.file.close()

    def _trace(self, dbapi_connection: Any, record: Any) -> None:
        pgconn = _pooler._driver(dbapi_connection).pgconn
        pgconn.trace(self.file.fileno())
        pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS | Trace.REGRESS_MODE)

    def sent(self, driver: Any) -> list[str]:
        """The queries traced on ``driver`` (the connection handed out), tracing ended."""
        driver.pgconn.untrace()  # flushes what libpq wrote
        self.file.seek(0)
        queries = []
        for line in self.file.read().splitlines():
            side, _, kind, *text = line.split("\t", 3)  # a message without a body has none
            if side == "F" and kind in ("Query", "Parse"):
                queries.append(f"{kind} {text[0].strip()}")
        return queries


@pytest.mark.parametrize("isolation_level", [None, "AUTOCOMMIT"])
def test_the_pooler_check_is_one_query_and_leaves_the_connection_as_it_was(
    database_url: str, isolation_level: str | None
) -> None:
    # Whether a pooler sits between is asked of every connection the pool makes (the new
    # processes of a service that forks, a NullPool's every checkout): one round trip, with
    # no BEGIN nor ROLLBACK around it, and the connection in the engine's own mode after.
    options = {"isolation_level": isolation_level} if isolation_level else {}
    db = create_engine(database_url, poolclass=NullPool, **options)
    try:
        rp.Engine(db)
        db.connect().close()  # the first connection: the dialect asks the server its settings
        with Traced(db) as traced, db.connect() as conn:
            driver = conn.connection.driver_connection
            assert traced.sent(driver) == ['Query "SELECT pg_backend_pid()"']
            assert driver.autocommit is (isolation_level == "AUTOCOMMIT")  # type: ignore[union-attr]
            assert conn.connection.info.get(_pooler.UNPREPARED) is None  # PostgreSQL itself
    finally:
        db.dispose()


def test_the_pooler_check_after_a_listener_that_left_a_transaction_open(database_url: str) -> None:
    # A listener of the application's, before the engine's, that executed without
    # committing: the connection cannot go to autocommit then. The check runs in that
    # transaction and ends it, as it always has, and the connection works.
    db = create_engine(database_url, poolclass=NullPool)

    @sa.event.listens_for(db, "connect")
    def mine(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.cursor().execute("SELECT 1")

    try:
        rp.Engine(db)
        db.connect().close()
        with Traced(db) as traced, db.connect() as conn:
            driver = conn.connection.driver_connection
            assert traced.sent(driver) == [
                'Query "BEGIN"', 'Query "SELECT 1"', 'Query "SELECT pg_backend_pid()"',
                'Query "ROLLBACK"',
            ]  # fmt: skip
            assert driver.info.transaction_status == TransactionStatus.IDLE  # type: ignore[union-attr]
            assert conn.scalar(sa.text("SELECT 2")) == 2
    finally:
        db.dispose()


@pytest.mark.parametrize("setting", [None, True, False])
def test_statements_are_prepared_unless_the_engine_is_told_not_to(
    database_url: str, scope: str, setting: bool | None
) -> None:
    # Connected to PostgreSQL itself, the default prepares (as True does); False prepares
    # nothing, the engine's statements nor psycopg's, and requests work all the same.
    db = create_engine(database_url, pool_size=1, max_overflow=0)
    engine = rp.Engine(db, prepared_statements=setting)
    op: rp.Operation[Any] = rp.Operation(f"prepared-{setting}")

    @op.atomic_phase("done")
    def done(tx: rp.AtomicContext, params: Any) -> rp.Response:
        for _ in range(6):  # past psycopg's threshold of 5
            tx.execute("SELECT %s::int", (1,))
        return rp.Response(201)

    engine.register(op)
    for n in range(3):
        assert engine.run(op, key=f"k{n}", params={}, scope=scope).status == 201
    names, threshold = _prepared_on(db)
    ours = {name for name in names if name.startswith("recoverypoint_")}
    if setting is False:
        assert names == set() and threshold is None
    else:
        assert ours and any(name.startswith("_pg3_") for name in names)
    with pytest.raises(ValueError, match="prepared_statements"):
        rp.Engine(db, prepared_statements=not setting)
    db.dispose()
