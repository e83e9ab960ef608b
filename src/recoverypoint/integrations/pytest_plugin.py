"""recoverypoint's pytest plugin (registered as ``pytest11``, so installing recoverypoint
is enough). Its fixtures give each test session a migrated database of its own, and each
test an engine, faults that are off again afterwards and a key no other run uses::

    def test_a_crash_after_the_charge_charges_once(rp_engine, rp_faults, rp_key):
        rp_engine.register(rides)
        with rp_faults.injected("after_foreign:charge_created"), pytest.raises(InjectedFault):
            rp_engine.run(rides, key=rp_key, params=body, scope="u1")
        assert rp_engine.run(rides, key=rp_key, params=body, scope="u1").status == 201

The database is made on the server named by ``$RECOVERYPOINT_TEST_DATABASE_URL`` or the
``recoverypoint_test_database_url`` ini option (the environment wins), else on an embedded
server (``pip install 'recoverypoint[embedded]'``). The ``explore_crashes`` fixture runs
:func:`recoverypoint.explore.explore` and fails the test with its report::

    def test_checkout_is_crash_safe(explore_crashes):
        explore_crashes(engine, checkout, {"amount": 2000}, check=one_charge, tables=["orders"])
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from .. import migrate
from ..database import create_engine, normalize_url
from ..engine import Engine
from ..explore import Exploration, Subject, explore
from ..testing import Clock, Faults, faults, temporary_database

if TYPE_CHECKING:
    from ..engine import AsyncEngine

SERVER_URL_ENV = "RECOVERYPOINT_TEST_DATABASE_URL"
SERVER_URL_INI = "recoverypoint_test_database_url"
# Beyond printable ASCII (a space is allowed in a key, but is awkward in a log line).
_NOT_IN_A_KEY = re.compile(r"[^\x21-\x7e]")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        SERVER_URL_INI,
        f"PostgreSQL server on which the rp_database fixture creates the session's database "
        f"(${SERVER_URL_ENV} wins); unset, an embedded server",
    )


@pytest.fixture(scope="session")
def rp_server_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """The server the test database is created on: ``$RECOVERYPOINT_TEST_DATABASE_URL``,
    else the ``recoverypoint_test_database_url`` ini option, else an embedded server
    started for the session."""
    url = os.environ.get(SERVER_URL_ENV) or pytestconfig.getini(SERVER_URL_INI)
    if url:
        yield normalize_url(url).render_as_string(hide_password=False)
        return
    from ..embedded import embedded_database

    with ExitStack() as stack:
        try:
            started = stack.enter_context(embedded_database())
        except RuntimeError as exc:
            pytest.fail(
                f"recoverypoint's fixtures need a PostgreSQL server: set ${SERVER_URL_ENV} "
                f"(or the {SERVER_URL_INI} ini option) to one you may create databases on, "
                f"or pip install 'recoverypoint[embedded]' ({exc})",
                pytrace=False,
            )
        yield started


@pytest.fixture(scope="session")
def rp_database(rp_server_url: str) -> Iterator[str]:
    """URL of a database of this test session alone, migrated to the newest schema, and
    dropped at the end."""
    with temporary_database(rp_server_url, prefix="rp_pytest") as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(scope="session")
def rp_db(rp_database: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine on :func:`rp_database`: make your tables, count your rows."""
    db = create_engine(rp_database)
    yield db
    db.dispose()


@pytest.fixture
def rp_engine(rp_db: sa.Engine) -> Engine:
    """A new :class:`~recoverypoint.Engine` on :func:`rp_database` for this test."""
    return Engine(rp_db)


@pytest.fixture
def rp_async_engine(rp_database: str) -> Iterator[AsyncEngine]:
    """A new :class:`~recoverypoint.AsyncEngine` on :func:`rp_database` for this test. It
    keeps no connection between transactions, so none outlives the test's event loop (run
    the test with anyio's or pytest-asyncio's marker)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from ..engine.run_async import AsyncEngine

    async_db = create_async_engine(normalize_url(rp_database), poolclass=NullPool)
    engine = AsyncEngine(async_db)
    yield engine
    engine.db.dispose()  # the workers' sync engine; the async one holds nothing


@pytest.fixture
def rp_faults() -> Iterator[Faults]:
    """The process-wide :data:`recoverypoint.testing.faults`, disarmed before and after
    the test, with its ``fired`` counts emptied."""
    faults.disarm()
    faults.fired.clear()
    try:
        yield faults
    finally:
        faults.disarm()
        faults.fired.clear()


@pytest.fixture
def rp_clock(rp_db: sa.Engine) -> Clock:
    """recoverypoint's time on :func:`rp_database`, moved forward by ``rp_clock.advance(...)``
    (:class:`~recoverypoint.testing.Clock`): leases, back-off, retention and providers'
    windows run out without the test sleeping through them."""
    return Clock(rp_db)


@pytest.fixture
def rp_key(request: pytest.FixtureRequest) -> str:
    """An idempotency key no other test and no other run uses: ``<test name>-<random hex>``."""
    return unique_key(request.node.name)


def unique_key(name: str) -> str:
    """``<name>-<random hex>`` as a valid idempotency key: what a key may not hold (beyond
    printable ASCII) becomes ``_``, and the name is cut to leave room for the hex."""
    return f"{_NOT_IN_A_KEY.sub('_', name)[:200]}-{secrets.token_hex(8)}"


@pytest.fixture
def explore_crashes() -> Callable[..., Exploration]:
    """``explore_crashes(engine, operation, params, **options)`` (or ``(subject,
    **options)``) explores every crash schedule and fails the test with the report when
    an invariant breaks; it returns the :class:`~recoverypoint.explore.Exploration`."""

    def run(*args: Any, **options: Any) -> Exploration:
        if args and isinstance(args[0], Subject):
            found = args[0].explore(*args[1:], **options)
        else:
            found = explore(*args, **options)
        if not found.ok:
            pytest.fail(found.report(), pytrace=False)
        return found

    return run
