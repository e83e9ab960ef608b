"""The pytest plugin's fixtures, run as a user runs them: test files in a directory of their
own, in a pytest of their own (pytester, in a subprocess), on the real PostgreSQL."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from recoverypoint.integrations.pytest_plugin import SERVER_URL_ENV, SERVER_URL_INI, unique_key
from recoverypoint.keys import validate_key

pytestmark = pytest.mark.slow  # pytest as a subprocess

# A user's application: an operation that creates a ride and charges a fake provider kept
# in the same database, which dedupes on the downstream key and records every call. After
# each test, one charge more and no other ride: whatever the test did, it charged once.
APP = '''
import pytest
import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint.testing import InjectedFault

PROVIDER = {}

rides = rp.Operation("create_ride")


@rides.atomic_phase("ride_created")
def create_ride(tx, params):
    tx.state["ride_id"] = tx.scalar(
        "INSERT INTO rides (origin) VALUES (%(origin)s) RETURNING id", params
    )


@rides.foreign_step("charge_created")
def charge(step, params):
    with PROVIDER["db"].begin() as conn:
        conn.execute(sa.text("INSERT INTO provider_calls DEFAULT VALUES"))
        conn.execute(
            sa.text("INSERT INTO charges (key) VALUES (:k) ON CONFLICT DO NOTHING"),
            {"k": step.downstream_key()},
        )
    return {"charged": True}


@rides.atomic_phase("finished")
def finish(tx, params):
    return rp.Response(201, {"ride_id": tx.state["ride_id"]})


body = {"origin": "Paris"}


@pytest.fixture(scope="session")
def app_tables(rp_db):
    with rp_db.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS rides (id bigserial PRIMARY KEY, origin text);"
            "CREATE TABLE IF NOT EXISTS charges (key text PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS provider_calls (id bigserial PRIMARY KEY)"
        )
    PROVIDER["db"] = rp_db
    with open("database.txt", "w") as out:
        out.write(rp_db.url.database)
    with open("url.txt", "w") as out:
        out.write(rp_db.url.render_as_string())


def counts(db):
    with db.connect() as conn:
        return {
            table: conn.scalar(sa.text(f"SELECT count(*) FROM {table}"))
            for table in ("rides", "charges")
        }


@pytest.fixture(autouse=True)
def charged_once(app_tables, rp_db):
    before = counts(rp_db)
    yield
    after = counts(rp_db)
    assert {t: after[t] - before[t] for t in after} == {"rides": 1, "charges": 1}
'''

# A fault-injection test like the one docs/how-to/testing.md shows (which
# tests/test_docs_testing.py runs as written).
CRASH_TEST = '''
def test_a_crash_after_the_charge_charges_once(rp_engine, rp_faults, rp_key):
    rp_engine.register(rides)
    with rp_faults.injected("after_foreign:charge_created"), pytest.raises(InjectedFault):
        rp_engine.run(rides, key=rp_key, params=body, scope="u1")   # charged, not yet recorded
    assert rp_engine.run(rides, key=rp_key, params=body, scope="u1").status == 201
'''


@pytest.fixture
def user_env(monkeypatch: pytest.MonkeyPatch, server_url: str) -> str:
    monkeypatch.setenv(SERVER_URL_ENV, server_url)
    return server_url


def database_exists(server_url: str, name: str) -> bool:
    db = sa.create_engine(server_url)
    try:
        with db.connect() as conn:
            found = conn.scalar(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            )
    finally:
        db.dispose()
    return found is not None


def test_a_users_tests_pass_twice_on_the_same_database(
    pytester: pytest.Pytester, user_env: str
) -> None:
    tests = APP + CRASH_TEST
    pytester.makepyfile(test_rides=tests)
    count = len(set(re.findall(r"^(?:async )?def (test_\w+)", tests, flags=re.M)))
    # The file twice in one session: the second run meets the first one's keys.
    twice = pytester.runpytest_subprocess("test_rides.py", "test_rides.py", "--keep-duplicates")
    twice.assert_outcomes(passed=2 * count)
    name = (pytester.path / "database.txt").read_text()
    assert name.startswith("rp_pytest_")
    assert not database_exists(user_env, name), "the session's database was left behind"
    # And again in a new session, on a database of its own.
    pytester.runpytest_subprocess("test_rides.py").assert_outcomes(passed=count)
    assert (pytester.path / "database.txt").read_text() != name


def test_faults_armed_by_a_failing_test_are_off_in_the_next(
    pytester: pytest.Pytester, user_env: str
) -> None:
    pytester.makepyfile(
        test_faults=APP
        + '''
def test_arms_and_fails(rp_engine, rp_faults, rp_key):
    rp_engine.register(rides)
    rp_faults.arm("before_foreign:*")
    rp_engine.run(rides, key=rp_key, params=body, scope="u1")


def test_next(rp_engine, rp_faults, rp_key):
    assert not rp_faults.fired
    rp_engine.register(rides)
    assert rp_engine.run(rides, key=rp_key, params=body, scope="u1").status == 201
'''
    )
    result = pytester.runpytest_subprocess()
    # The first fails twice over: the injected fault, then its check (no charge made).
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*InjectedFault: before_foreign:charge_created*"])


def test_the_clock_moves_the_tests_keys_forward(
    pytester: pytest.Pytester, user_env: str
) -> None:
    pytester.makepyfile(
        test_clock=APP
        + """
def test_71_hours_later_it_replays(rp_engine, rp_clock, rp_key, rp_db):
    rp_engine.register(rides)
    assert not rp_engine.run(rides, key=rp_key, params=body, scope="u1").replayed
    rp_clock.advance(hours=71)
    assert rp_engine.run(rides, key=rp_key, params=body, scope="u1").replayed
    rp_clock.advance(hours=1)
    with rp_db.connect() as conn:
        age = conn.scalar(
            sa.text("SELECT now() - finished_at FROM idempotency_keys WHERE idempotency_key = :k"),
            {"k": rp_key},
        )
    assert age >= rp_clock.moved
"""
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_the_async_engine(pytester: pytest.Pytester, user_env: str) -> None:
    pytester.makepyfile(
        test_async=APP
        + '''
arides = rp.Operation("create_ride_async")


@arides.atomic_phase("ride_created")
async def acreate_ride(tx, params):
    tx.state["ride_id"] = await tx.scalar(
        "INSERT INTO rides (origin) VALUES (%(origin)s) RETURNING id", params
    )


@arides.foreign_step("charge_created")
async def acharge(step, params):
    return charge(step, params)


@arides.atomic_phase("finished")
async def afinish(tx, params):
    return rp.Response(201, {"ride_id": tx.state["ride_id"]})


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_async(rp_async_engine, rp_faults, rp_key):
    rp_async_engine.register(arides)
    with rp_faults.injected("after_foreign:charge_created"), pytest.raises(InjectedFault):
        await rp_async_engine.run(arides, key=rp_key, params=body, scope="u1")
    outcome = await rp_async_engine.run(arides, key=rp_key, params=body, scope="u1")
    assert outcome.status == 201


@pytest.mark.anyio
async def test_async_again(rp_async_engine, rp_key):
    rp_async_engine.register(arides)
    assert (await rp_async_engine.run(arides, key=rp_key, params=body, scope="u1")).status == 201
'''
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=2)


def test_the_ini_option_names_the_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, server_url: str
) -> None:
    monkeypatch.delenv(SERVER_URL_ENV, raising=False)
    pytester.makeini(f"[pytest]\n{SERVER_URL_INI} = {server_url}\n")
    pytester.makepyfile(test_ini=APP + CRASH_TEST)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    assert database_exists(server_url, "postgres")  # the server's, not an embedded one
    name = (pytester.path / "database.txt").read_text()
    assert name.startswith("rp_pytest_") and not database_exists(server_url, name)


def test_without_a_server_an_embedded_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, server_url: str
) -> None:
    monkeypatch.delenv(SERVER_URL_ENV, raising=False)
    pytester.makepyfile(test_embedded=APP + CRASH_TEST)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    server = sa.make_url(server_url)
    used = sa.make_url((pytester.path / "url.txt").read_text())
    assert (used.host, used.port, used.query) != (server.host, server.port, server.query)


@given(st.text())
def test_a_unique_key_is_a_valid_key_from_any_test_name(name: str) -> None:
    key = unique_key(name)
    assert validate_key(key) == key
    assert unique_key(name) != key
