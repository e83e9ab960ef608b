"""An atomic phase cannot end the engine's transaction, whichever way it tries: SQLAlchemy's
connection and ORM Session, psycopg's connection under them, a cursor of the phase, one
statement or several in one string, on rp.Engine and rp.AsyncEngine. Each is refused before
anything commits: the wallet keeps its balance, the key is released with the error, and
once the phase is fixed the retry debits the wallet once. What the guard reads as ending a
transaction is what PostgreSQL does (the server says, for any text hypothesis makes)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
import sqlalchemy.orm as sa_orm
from hypothesis import HealthCheck, given, settings
from psycopg import sql
from psycopg.pq import TransactionStatus
from rides import count
from sql_endings import ending, texts

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.engine import phase_guard

# What the phase does after its writes; None: nothing.
Escape = Callable[[rp.AtomicContext], object]
AsyncEscape = Callable[[rp.AsyncAtomicContext], Awaitable[object]]

DEBIT = "UPDATE counters SET n = n - 1 WHERE name = %(scope)s"
RECORD = "INSERT INTO audit_records (scope, action, key_id) VALUES (%(scope)s, 'debit', %(key)s)"


def _driver(tx: rp.AtomicContext) -> psycopg.Connection[Any]:
    return tx.connection.connection.driver_connection  # type: ignore[no-any-return]


def _session_rollback(tx: rp.AtomicContext) -> None:
    tx.session.execute(sa.text("SELECT 1"))
    tx.session.rollback()


def _copy(tx: rp.AtomicContext) -> None:
    with tx.cursor().copy("COMMIT"):
        pass


ESCAPES: dict[str, Escape] = {
    "SQLAlchemy commit()": lambda tx: tx.connection.commit(),
    "SQLAlchemy rollback()": lambda tx: tx.connection.rollback(),
    "SQLAlchemy COMMIT": lambda tx: tx.connection.execute(sa.text("COMMIT")),
    "SQLAlchemy SELECT 1; COMMIT": lambda tx: tx.connection.exec_driver_sql("SELECT 1; COMMIT"),
    "Session rollback()": _session_rollback,
    "psycopg commit()": lambda tx: _driver(tx).commit(),
    "psycopg rollback()": lambda tx: _driver(tx).rollback(),
    "psycopg execute(COMMIT)": lambda tx: _driver(tx).execute("commit"),
    "tx.execute(SELECT 1; COMMIT)": lambda tx: tx.execute("SELECT 1; COMMIT"),
    "tx.execute(sql.SQL)": lambda tx: tx.execute(sql.SQL("{}").format(sql.SQL("END"))),
    "tx.execute(bytes)": lambda tx: tx.execute(b"-- done\nABORT"),  # type: ignore[arg-type]
    "cursor COMMIT AND CHAIN": lambda tx: tx.cursor().execute("commit and chain"),
    "cursor executemany": lambda tx: tx.cursor().executemany("COMMIT", [()]),
    "cursor stream": lambda tx: list(tx.cursor().stream("COMMIT")),
    "cursor copy": _copy,
    "cursor copy(statement=)": lambda tx: tx.cursor().copy(statement="COMMIT").__enter__(),
}


async def _async_driver(tx: rp.AsyncAtomicContext) -> psycopg.AsyncConnection[Any]:
    raw = await tx.connection.get_raw_connection()
    return raw.driver_connection  # type: ignore[return-value]


async def _async_session_rollback(tx: rp.AsyncAtomicContext) -> None:
    await tx.session.execute(sa.text("SELECT 1"))
    await tx.session.rollback()


async def _async_driver_commit(tx: rp.AsyncAtomicContext) -> None:
    await (await _async_driver(tx)).commit()


async def _async_driver_execute(tx: rp.AsyncAtomicContext) -> None:
    await (await _async_driver(tx)).execute("COMMIT")


async def _async_cursor_commit(tx: rp.AsyncAtomicContext) -> None:
    await tx.cursor().execute("/* done */ COMMIT")


async def _async_stream(tx: rp.AsyncAtomicContext) -> None:
    async for _ in tx.cursor().stream("END"):
        pass


ASYNC_ESCAPES: dict[str, AsyncEscape] = {
    "SQLAlchemy commit()": lambda tx: tx.connection.commit(),
    "SQLAlchemy SELECT 1; COMMIT": lambda tx: tx.connection.exec_driver_sql("SELECT 1;COMMIT"),
    "Session rollback()": _async_session_rollback,
    "psycopg commit()": _async_driver_commit,
    "psycopg execute(COMMIT)": _async_driver_execute,
    "tx.execute(SELECT 1; COMMIT)": lambda tx: tx.execute("SELECT 1; COMMIT"),
    "cursor COMMIT": _async_cursor_commit,
    "cursor stream": _async_stream,
}


def debiting(name: str, escape: list[Any]) -> rp.Operation[Any]:
    """Opens, then debits the wallet of the scope and records it, then does ``escape[0]``."""
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("opened")
    def open_(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.atomic_phase("debited")
    def debit(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute(DEBIT, {"scope": params["scope"]})
        tx.execute(RECORD, {"scope": params["scope"], "key": tx.key_id})
        if escape[0] is not None:
            escape[0](tx)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    return op


def async_debiting(name: str, escape: list[Any]) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("opened")
    async def open_(tx: rp.AsyncAtomicContext, params: Any) -> None:
        pass

    @op.atomic_phase("debited")
    async def debit(tx: rp.AsyncAtomicContext, params: Any) -> None:
        await tx.execute(DEBIT, {"scope": params["scope"]})
        await tx.execute(RECORD, {"scope": params["scope"], "key": tx.key_id})
        if escape[0] is not None:
            await escape[0](tx)

    @op.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
        return rp.Response(201)

    return op


@pytest.fixture
def engine(engine_both_ways: rp.Engine) -> rp.Engine:
    """Each test on both of the engine's paths (see conftest's engine_both_ways)."""
    return engine_both_ways


@pytest.fixture
def wallet(db: sa.Engine, business_tables: None, scope: str) -> str:
    """The scope's wallet, with 1000 in it."""
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO counters VALUES (:s, 1000)"), {"s": scope})
    return scope


def wallet_and_debits(db: sa.Engine, scope: str) -> tuple[int, int]:
    return (
        count(db, "SELECT n FROM counters WHERE name = :s", s=scope),
        count(db, "SELECT count(*) FROM audit_records WHERE scope = :s", s=scope),
    )


def released_with(db: sa.Engine, scope: str) -> tuple[str, bool, str]:
    with db.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT recovery_point, locked_at IS NULL, last_error FROM idempotency_keys "
                "WHERE scope = :s"
            ),
            {"s": scope},
        ).one()
    return row[0], row[1], row[2].partition(":")[0]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_phase_cannot_end_its_transaction(
    engine: rp.Engine, db: sa.Engine, wallet: str, name: str
) -> None:
    escape: list[Any] = [ESCAPES[name]]
    op = debiting(f"ends_{abs(hash(name))}", escape)
    engine.register(op)
    for _ in range(2):  # the client's retries: refused each time, nothing committed
        with pytest.raises(rp.TransactionEnded, match="'debited'"):
            engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
        assert wallet_and_debits(db, wallet) == (1000, 0)
        assert released_with(db, wallet) == ("opened", True, "TransactionEnded")

    escape[0] = None  # the phase fixed: the retry debits once, the next one replays
    assert engine.run(op, key="k", params={"scope": wallet}, scope=wallet).status == 201
    assert engine.run(op, key="k", params={"scope": wallet}, scope=wallet).replayed
    assert wallet_and_debits(db, wallet) == (999, 1)


@pytest.fixture
async def async_engine(database_url: str, business_tables: None) -> AsyncIterator[rp.AsyncEngine]:
    async_db = sa_async.create_async_engine(normalize_url(database_url), pool_size=2)
    engine = rp.AsyncEngine(async_db)
    yield engine
    await engine.dispose()
    await async_db.dispose()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", ASYNC_ESCAPES)
async def test_an_async_phase_cannot_end_its_transaction(
    async_engine: rp.AsyncEngine, db: sa.Engine, wallet: str, name: str
) -> None:
    escape: list[Any] = [ASYNC_ESCAPES[name]]
    op = async_debiting(f"async_ends_{abs(hash(name))}", escape)
    async_engine.register(op)
    with pytest.raises(rp.TransactionEnded, match="'debited'"):
        await async_engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)
    assert released_with(db, wallet) == ("opened", True, "TransactionEnded")

    escape[0] = None
    assert (await async_engine.run(op, key="k", params={"scope": wallet}, scope=wallet)).status
    assert wallet_and_debits(db, wallet) == (999, 1)


def test_a_sessions_commit_is_the_phases(engine: rp.Engine, db: sa.Engine, wallet: str) -> None:
    """A Session bound to the phase's connection commits nothing of its own: what it wrote
    commits with the phase, or rolls back with it."""
    fail = [True]
    op: rp.Operation[Any] = rp.Operation("session_commits")

    @op.atomic_phase("finished")
    def debit(tx: rp.AtomicContext, params: Any) -> rp.Response:
        with sa_orm.Session(bind=tx.connection) as session:
            session.execute(sa.text(DEBIT.replace("%(scope)s", ":scope")), params)
            session.commit()
        if fail[0]:
            raise rp.Retryable("after the Session's commit")
        return rp.Response(201)

    engine.register(op)
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)
    fail[0] = False
    assert engine.run(op, key="k", params={"scope": wallet}, scope=wallet).status == 201
    assert wallet_and_debits(db, wallet) == (999, 0)


# -- the statements the guard refuses are those that end a transaction on the server ---------

SQL_TEXTS = settings(
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def oracle(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection of psycopg's own, no engine's, that runs text as it is; never prepared,
    so that several statements may go in one string."""
    url = sa.make_url(database_url).set(drivername="postgresql")
    with psycopg.connect(
        url.render_as_string(hide_password=False), autocommit=True, prepare_threshold=None
    ) as conn:
        yield conn


def ends_on_the_server(conn: psycopg.Connection[Any], text: str) -> bool:
    """Whether ``text``, run in a transaction, ended it (a transaction that follows on its
    heels, with AND CHAIN, is another one)."""
    conn.execute("BEGIN")
    conn.execute("SET LOCAL application_name = 'rp-guard-open'")
    conn.execute(text.encode())
    status = conn.info.transaction_status
    assert status != TransactionStatus.INERROR, text
    still_open = status == TransactionStatus.INTRANS and (
        conn.execute("SELECT current_setting('application_name')").fetchone() == ("rp-guard-open",)
    )
    if status != TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
    return not still_open


def refused(text: str) -> bool:
    try:
        phase_guard.check_statement(text, "p")
    except rp.TransactionEnded:
        return True
    return False


@SQL_TEXTS
@given(text=texts())
@pytest.mark.slow
def test_the_guard_reads_sql_as_the_server_does(oracle: psycopg.Connection[Any], text: str) -> None:
    assert refused(text) == ends_on_the_server(oracle, text), text


@pytest.mark.parametrize(
    ("text", "ends"),
    [
        ("PREPARE TRANSACTION 'x'", True),
        ("prepare /* two-phase */ transaction 'x'", True),
        ("COMMIT PREPARED 'x'", True),
        ("PREPARE fetch_it AS SELECT 1", False),
        ("", False),
        ("/* an unfinished comment; COMMIT", False),
        ("SELECT 'an unfinished string; COMMIT", False),
        ("SELECT $x$ an unfinished body; COMMIT", False),
        ("SELECT $1; COMMIT", True),
        ("SELECT 1 AS end_date; ROLLBACK TO SAVEPOINT s; ENDING", False),
    ],
)
def test_statements_the_server_cannot_run_here(text: str, ends: bool) -> None:
    assert refused(text) == ends


PHASES = settings(
    max_examples=30,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PHASES
@given(text=texts(ends=True, runnable=False))
@pytest.mark.slow
def test_any_ending_text_through_a_cursor_of_the_phase_is_refused(
    engine: rp.Engine, db: sa.Engine, wallet: str, text: str
) -> None:
    op = debiting(f"ends_by_text_{uuid.uuid4().hex}", [lambda tx: tx.cursor().execute(text)])
    engine.register(op)
    with pytest.raises(rp.TransactionEnded):
        engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)


@PHASES
@given(statement=ending(runnable=False))
@pytest.mark.slow
def test_an_ending_statement_is_refused_through_sqlalchemy(
    engine: rp.Engine, db: sa.Engine, wallet: str, statement: str
) -> None:
    end = [lambda tx: tx.connection.exec_driver_sql(statement)]
    op = debiting(f"ends_by_sqlalchemy_{uuid.uuid4().hex}", end)
    engine.register(op)
    with pytest.raises(rp.TransactionEnded):
        engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)


# -- what does not end the transaction goes through -------------------------------------------


def _pipelined(tx: rp.AtomicContext, params: Any) -> None:
    # psycopg's pipeline mode: the transaction is ACTIVE, not idle in it, between statements.
    with _driver(tx).pipeline(), tx.cursor() as cursor:
        cursor.execute(DEBIT, {"scope": params["scope"]})
        cursor.execute(RECORD, {"scope": params["scope"], "key": tx.key_id})


def _after_a_caught_error(tx: rp.AtomicContext, params: Any) -> None:
    # An error caught without a savepoint: the transaction is aborted, not ended; the next
    # statement gets the server's own answer.
    with pytest.raises(psycopg.errors.DivisionByZero):
        tx.execute("SELECT 1 / 0")
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        tx.execute("SELECT 1")
    raise rp.Retryable("aborted by a caught error")


def test_a_pipeline_of_the_phase_goes_through(
    engine: rp.Engine, db: sa.Engine, wallet: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("pipelined")

    @op.atomic_phase("finished")
    def debit(tx: rp.AtomicContext, params: Any) -> rp.Response:
        _pipelined(tx, params)
        return rp.Response(201)

    engine.register(op)
    assert engine.run(op, key="k", params={"scope": wallet}, scope=wallet).status == 201
    assert wallet_and_debits(db, wallet) == (999, 1)


def test_a_statement_after_a_caught_error_gets_the_servers_answer(
    engine: rp.Engine, db: sa.Engine, wallet: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("caught_error")

    @op.atomic_phase("finished")
    def debit(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(DEBIT, {"scope": params["scope"]})
        _after_a_caught_error(tx, params)
        return rp.Response(201)

    engine.register(op)
    with pytest.raises(rp.Retryable, match="aborted by a caught error"):
        engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)


def test_a_phase_that_returns_from_an_aborted_transaction_is_told_so(
    engine: rp.Engine, db: sa.Engine, wallet: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("returns_aborted")

    @op.atomic_phase("finished")
    def debit(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(DEBIT, {"scope": params["scope"]})
        # Caught without a savepoint: the transaction stays aborted.
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            tx.execute("SELECT 1 / 0")
        return rp.Response(201)

    engine.register(op)
    with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="savepoint"):
        engine.run(op, key="k", params={"scope": wallet}, scope=wallet)
    assert wallet_and_debits(db, wallet) == (1000, 0)
