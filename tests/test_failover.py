"""Exactly once when the database fails over, restarts, sits behind a pooler or goes away.

A primary and a streaming standby of the tests' own (tests/pgcluster.py) serve 8 client
threads on ``rp.Engine`` and 8 client tasks on ``rp.AsyncEngine`` booking rides: a ride
created, a charge at a payment provider that dedupes on the downstream key it is given, the
charge recorded and a receipt job staged, 201. The provider lives outside the failing
cluster (the test server's database), and records beside each charge the client request it
was made for (``scope/key``). Each client retries a request with the same key until it gets
a final answer, on the errors that say "retry" (``rp.DatabaseUnavailable``, ``rp.KeyInUse``,
``rp.LockLost``, ``rp.ConcurrentUpdate``); any other exception reaching it is a raw error.

While they run the primary is stopped immediately and the standby promoted (synchronous
replication; asynchronous, caught up and lagging), failed over and back, its backends
killed in storms, restarted, and PgBouncer (transaction pooling) told to RECONNECT, PAUSE and
RESUME, KILL. Then the completer runs once over the surviving database, and the figures are
counted: duplicate charges (0 in every mode), lost accepted requests (0 unless replication
was asynchronous and lagging: reported there), keys unfinished after the completer (0),
raw errors seen by callers (0), answers contradicting the stored one (0), and the time from
the promotion (or the disruption) to the first success of each engine, reported.

Without load: a request whose key record is lost with a lagging standby, sent again after the
promotion, is not charged again; a libpq multi-host URL follows the primary; and while the
database is down every caller (both engines, ``@rp.idempotent``, ``Engine.resume``, HTTP) is
told to retry, and is served once it is back.

Skipped without PostgreSQL 15's binaries or PgBouncer, unless RECOVERYPOINT_REQUIRE_SERVICES=1:
then those tests fail.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import http_apps
import httpx
import pgcluster
import pytest
import sqlalchemy as sa
from http_servers import serve_asgi, serve_wsgi
from rides import SCHEMA, Faults, Provider, ride_operation
from test_engine_async import Gate
from test_engine_async import rides as async_ride_operation
from workload import rows

import recoverypoint as rp
from recoverypoint import _pooler, migrate
from recoverypoint.database import create_engine
from recoverypoint.workers import Completer, CompleterResult

pytestmark = [
    pytest.mark.slow,  # clusters and a PgBouncer of its own, failed over under load
    # On one worker: the clusters' template and the PgBouncer made once, not on each, and
    # the tests' waits on servers (most of their time) kept from idling several workers.
    pytest.mark.xdist_group("failover"),
]

T = TypeVar("T")

CLIENTS = 8  # of each engine
REQUEST = rp.Request("POST", "/rides")
SYNC_OPERATION, ASYNC_OPERATION = "rides_sync", "rides_async"
# Short leases: a key whose lease could not be released during an outage is free again soon.
LEASE = timedelta(seconds=3)
# The errors that tell a client "retry with the same key"; anything else is a raw error.
RETRYABLE = (rp.DatabaseUnavailable, rp.KeyInUse, rp.LockLost, rp.ConcurrentUpdate)
# Successes awaited before a disruption, and after it, in each scenario.
SUCCESSES = 40


def engine_url(cluster: pgcluster.Cluster) -> str:
    """The URL the load's engines are built from: every server of the cluster in libpq's
    ``h1:p1,h2:p2`` form, and ``target_session_attrs=read-write``, so that they follow the
    primary (SQLAlchemy's repeated ``host`` form has a test of its own below)."""
    return cluster.url()


@pytest.fixture(scope="session")
def pg_template() -> Iterator[pgcluster.Template]:
    """A data directory with the migrated database and the rides tables, copied for the
    primary of every cluster."""
    lacking = pgcluster.missing()
    if lacking:
        message = (
            f"missing {', '.join(lacking)}: the failover tests run PostgreSQL 15's binaries "
            "and PgBouncer (apt-get install postgresql-15 pgbouncer)"
        )
        if os.environ.get("RECOVERYPOINT_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; RECOVERYPOINT_REQUIRE_SERVICES=1 requires them")
        pytest.skip(message)

    def prepare(url: str) -> None:
        migrate.upgrade(url)
        db = create_engine(url)
        try:
            with db.begin() as conn:
                conn.exec_driver_sql(SCHEMA)
                conn.exec_driver_sql(http_apps.SCHEMA)
        finally:
            db.dispose()

    with pgcluster.template(prepare) as made:
        yield made


# -- the clients -----------------------------------------------------------------------------

# Runs one client request (scope, key) on an engine, once; raises what the engine raised.
Call = Callable[[str, str], rp.Outcome]


def params(scope: str, key: str) -> dict[str, str]:
    return {"scope": f"{scope}/{key}"}  # the provider records it beside the charge


@contextmanager
def engines(url: str, provider: Provider) -> Iterator[dict[str, Call]]:
    """A call on a new ``rp.Engine``, and one on a new ``rp.AsyncEngine`` whose every call
    is a task on an event loop of the engine's own (in a thread): the clients' retry logic
    is written once, for both."""
    sync_engine = rp.Engine(url)
    sync_operation = ride_operation(SYNC_OPERATION, provider, Faults(), lock_timeout=LEASE)
    sync_engine.register(sync_operation)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    async def new_async_engine() -> rp.AsyncEngine:
        return rp.AsyncEngine(url)  # its pool is the loop's

    async_engine = on_loop(new_async_engine())
    async_operation = async_ride_operation(ASYNC_OPERATION, provider, Gate(), lock_timeout=LEASE)
    async_engine.register(async_operation)

    def run_sync(scope: str, key: str) -> rp.Outcome:
        return sync_engine.run(
            sync_operation, key=key, params=params(scope, key), scope=scope, request=REQUEST
        )

    def run_async(scope: str, key: str) -> rp.Outcome:
        return on_loop(
            async_engine.run(
                async_operation, key=key, params=params(scope, key), scope=scope, request=REQUEST
            )
        )

    try:
        yield {"sync": run_sync, "async": run_async}
    finally:
        on_loop(async_engine.dispose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        sync_engine.dispose()


@dataclass
class Answer:
    engine: str
    status: int
    body: Any
    at: float


@dataclass
class Load:
    """The clients of both engines, and what they saw."""

    provider: Provider
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    answers: dict[tuple[str, str], Answer] = field(default_factory=dict)
    raw_errors: Counter[str] = field(default_factory=Counter)
    retries: Counter[str] = field(default_factory=Counter)
    gave_up: list[tuple[str, str]] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    giving_up: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)
    in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, engine: str, call: Call, n: int) -> None:
        """Requests one after the other, each retried with its key until it is answered."""
        scope = f"{self.tag}-{engine}-{n}"
        requests = 0
        while not self.stopping.is_set():
            requests += 1
            key = f"r{requests}"
            while not self.giving_up.is_set():
                if self.held.is_set():
                    self.giving_up.wait(0.01)
                    continue
                with self._lock:
                    self.in_flight += 1
                try:
                    outcome = call(scope, key)
                except Exception as exc:
                    self.giving_up.wait(self._failed(exc))
                else:
                    with self._lock:
                        self.in_flight -= 1
                        now = time.monotonic()
                        self.answers[scope, key] = Answer(engine, outcome.status, outcome.body, now)
                    break
            else:
                with self._lock:
                    self.gave_up.append((scope, key))
                return

    def _failed(self, exc: Exception) -> float:
        """Count ``exc``; how long to wait before the next attempt."""
        with self._lock:
            self.in_flight -= 1
            if isinstance(exc, RETRYABLE):
                self.retries[type(exc).__name__] += 1
            else:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                name = f"{type(exc).__module__}.{type(exc).__name__}: {first_line[:80]}"
                self.raw_errors[f"{name} ({where.filename.rsplit('/', 1)[-1]}:{where.lineno})"] += 1
        if isinstance(exc, rp.KeyInUse):
            return min(float(exc.retry_after), 0.5)
        return 0.05

    # What the test waits on.

    def successes(self, engine: str | None = None, after: float = 0.0) -> list[float]:
        with self._lock:
            return sorted(
                a.at
                for a in self.answers.values()
                if a.at > after and (engine is None or a.engine == engine)
            )

    def wait_for_successes(self, count: int = SUCCESSES, after: float = 0.0) -> None:
        pgcluster.wait_until(
            lambda: len(self.successes(after=after)) >= count,
            f"{count} requests succeed",
            timeout=90,
        )

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """No client attempts anything inside (those in flight finish first)."""
        self.held.set()
        try:
            pgcluster.wait_until(lambda: self.in_flight == 0, "no request is in flight")
            yield
        finally:
            self.held.clear()


@contextmanager
def load(url: str, provider: Provider, drain: float = 30.0) -> Iterator[Load]:
    """Both engines' clients on ``url`` while inside; on the way out, each finishes the
    request it has (retrying) for up to ``drain`` seconds, then gives it up."""
    clients = Load(provider)
    with engines(url, provider) as calls:
        threads = [
            threading.Thread(target=clients.client, args=(engine, call, n), daemon=True)
            for engine, call in calls.items()
            for n in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        try:
            yield clients
        finally:
            clients.stopping.set()
            deadline = time.monotonic() + drain
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            clients.giving_up.set()
            for thread in threads:
                thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a client did not stop"


# -- the figures -----------------------------------------------------------------------------


@dataclass
class Figures:
    scenario: str
    answered: int
    duplicate_charges: int
    lost_accepted: int
    contradicted: int
    stuck: int
    gave_up: int
    raw_errors: Counter[str]
    retries: Counter[str]
    completer: CompleterResult
    first_success: dict[str, float | None]
    successes_after: dict[str, int]

    def invariants(self, *, may_lose: bool) -> dict[str, int]:
        counted = {
            "duplicate charges": self.duplicate_charges,
            "lost accepted requests": self.lost_accepted,
            "answers contradicting the stored one": self.contradicted,
            "keys unfinished after the completer": self.stuck,
            "raw errors seen by callers": sum(self.raw_errors.values()),
            "engines with no success after the disruption": sum(
                not n for n in self.successes_after.values()
            ),
        }
        if may_lose:
            del counted["lost accepted requests"]
        return counted

    def table(self) -> str:
        first = ", ".join(
            f"{engine} {'none' if s is None else f'{s:.2f} s'}"
            for engine, s in self.first_success.items()
        )
        lines = [
            f"{self.scenario}: {self.answered} requests answered, {self.gave_up} given up",
            f"  duplicate charges {self.duplicate_charges}, lost accepted requests "
            f"{self.lost_accepted}, answers contradicting the stored one {self.contradicted}, "
            f"keys unfinished after the completer {self.stuck}",
            f"  completer: finished {self.completer.finished}, failed {self.completer.failed}, "
            f"errors {self.completer.errors}",
            f"  first success after the disruption: {first}",
            f"  retries: {dict(self.retries)}",
            f"  raw errors seen by callers ({sum(self.raw_errors.values())}):",
            *(f"    {n} x {error}" for error, n in self.raw_errors.most_common()),
        ]
        return "\n".join(lines)


def settle(scenario: str, survivor: pgcluster.Server, clients: Load, disrupted: float) -> Figures:
    """Run the completer once over the surviving database, then count."""
    db = create_engine(survivor.url())
    completer_engine = rp.Engine(db)
    # The async clients' keys are completed by the same phases, in sync.
    for name in (SYNC_OPERATION, ASYNC_OPERATION):
        completer_engine.register(
            ride_operation(name, clients.provider, Faults(), lock_timeout=LEASE)
        )
    tag, mine = clients.tag, "FROM idempotency_keys WHERE scope LIKE :tag || '-%'"
    unfinished = f"{mine} AND finished_at IS NULL"
    try:
        # A lease its holder could not release (its database went away under it) runs out
        # first; a backoff is waited out at once, as time would.
        pgcluster.wait_until(
            lambda: (
                not rows(db, f"SELECT 1 {unfinished} AND locked_at > now() - :l", tag=tag, l=LEASE)
            ),
            "every unfinished key's lease has run out",
        )
        with db.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE idempotency_keys SET next_attempt_at = now() WHERE id IN "
                        f"(SELECT id {unfinished})"),
                {"tag": tag},
            )  # fmt: skip
        completer = Completer(completer_engine, min_age=0).run_once()
        columns = "scope, idempotency_key, response_status, response_body, finished_at"
        keys = {
            (r.scope, r.idempotency_key): r for r in rows(db, f"SELECT {columns} {mine}", tag=tag)
        }
    finally:
        completer_engine.dispose()
        db.dispose()
    charges = rows(
        clients.provider.db,
        "SELECT count(*) AS n FROM provider_charges WHERE scope LIKE :tag || '-%' GROUP BY scope",
        tag=tag,
    )
    stored = [(keys.get(request), answer) for request, answer in clients.answers.items()]
    return Figures(
        scenario=scenario,
        answered=len(clients.answers),
        duplicate_charges=sum(row.n > 1 for row in charges),
        lost_accepted=sum(row is None for row, _ in stored),
        contradicted=sum(
            row is not None and (row.response_status, row.response_body) != (a.status, a.body)
            for row, a in stored
        ),
        stuck=sum(row.finished_at is None for row in keys.values()),
        gave_up=len(clients.gave_up),
        raw_errors=clients.raw_errors,
        retries=clients.retries,
        completer=completer,
        first_success={
            engine: (s[0] - disrupted if (s := clients.successes(engine, disrupted)) else None)
            for engine in ("sync", "async")
        },
        successes_after={
            engine: len(clients.successes(engine, disrupted)) for engine in ("sync", "async")
        },
    )


def check(figures: Figures, request: pytest.FixtureRequest, *, may_lose: bool = False) -> None:
    """Report the figures (the test's properties, which conftest.py shows at the end of the
    run), then assert every invariant at once: the message shows them all."""

    def record_property(name: str, value: object) -> None:
        # pytest's record_property fixture warns under the default junit_family.
        request.node.user_properties.append((name, value))

    record_property("failover", figures.table())
    for engine, seconds in figures.first_success.items():
        record_property(f"first success after the disruption ({engine}), s", seconds)
    if may_lose:
        record_property("lost accepted requests (asynchronous, lagging)", figures.lost_accepted)
    counted = figures.invariants(may_lose=may_lose)
    assert counted == dict.fromkeys(counted, 0), figures.table()


# -- the scenarios -----------------------------------------------------------------------------

# What happens to the database under load; returns when it happened (the figures' "after").
Disruption = Callable[[pgcluster.Cluster, Load], float]


def scenario(
    name: str,
    request: pytest.FixtureRequest,
    provider: Provider,
    made: AbstractContextManager[pgcluster.Cluster],
    disrupt: Disruption,
    *,
    url: Callable[[pgcluster.Cluster], str] = engine_url,
    may_lose: bool = False,
) -> None:
    """Load on the cluster, the disruption once some requests are answered, more requests
    answered after it; then the completer, the figures and the invariants."""
    with made as cluster:
        with load(url(cluster), provider) as clients:
            clients.wait_for_successes()
            disrupted = disrupt(cluster, clients)
            clients.wait_for_successes(after=disrupted)
        figures = settle(name, cluster.primary, clients, disrupted)
    check(figures, request, may_lose=may_lose)


def failover(cluster: pgcluster.Cluster, clients: Load) -> float:
    """Stop the primary at once and promote the standby; when the promotion began."""
    cluster.stop_immediate()
    promoted = time.monotonic()
    cluster.promote()
    return promoted


def test_immediate_stop_and_promotion_with_synchronous_replication(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    made = pgcluster.cluster(pg_template, synchronous=True)
    scenario("synchronous failover", request, provider, made, failover)


def test_immediate_stop_and_promotion_with_a_caught_up_asynchronous_standby(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    def caught_up_failover(cluster: pgcluster.Cluster, clients: Load) -> float:
        with clients.quiesced():
            pgcluster.wait_until(cluster.caught_up, "the standby has replayed everything")
            return failover(cluster, clients)

    made = pgcluster.cluster(pg_template)
    scenario("asynchronous failover, caught up", request, provider, made, caught_up_failover)


def test_immediate_stop_and_promotion_with_a_lagging_asynchronous_standby(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    """Requests answered after the standby stopped receiving WAL are lost with the old
    primary (reported); none may be charged twice when their clients retry."""

    def lagging_failover(cluster: pgcluster.Cluster, clients: Load) -> float:
        cluster.lag()
        clients.wait_for_successes(after=time.monotonic())  # to be lost
        return failover(cluster, clients)

    made = pgcluster.cluster(pg_template)
    name = "asynchronous failover, lagging"
    scenario(name, request, provider, made, lagging_failover, may_lose=True)


def test_failover_and_back(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    def there_and_back(cluster: pgcluster.Cluster, clients: Load) -> float:
        failover(cluster, clients)
        clients.wait_for_successes(after=time.monotonic())
        cluster.failback()  # the old primary, rebuilt as a synchronous standby
        clients.wait_for_successes(after=time.monotonic())
        return failover(cluster, clients)

    made = pgcluster.cluster(pg_template, synchronous=True)
    scenario("failover and back", request, provider, made, there_and_back)


def answer(engine: str, url: str, provider: Provider, scope: str, key: str) -> rp.Outcome:
    """One request, on a new engine of the kind named, retried with the same key on the
    errors that say so (a raw error fails the test)."""
    deadline = time.monotonic() + 60
    with engines(url, provider) as calls:
        while True:
            try:
                return calls[engine](scope, key)
            except RETRYABLE:
                assert time.monotonic() < deadline, "no answer in 60 s"
                time.sleep(0.1)


def charges(provider: Provider, scope: str, key: str) -> int:
    """The provider's charges for one client request."""
    with provider.db.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM provider_charges WHERE scope = :s"),
                {"s": params(scope, key)["scope"]},
            ).scalar_one()
        )


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_a_key_record_lost_with_a_lagging_standby_is_not_charged_again(
    engine: str, pg_template: pgcluster.Template, provider: Provider
) -> None:
    """Deterministic: a request finished on a primary whose standby lags, the primary lost,
    the same request (same key, same params) again on the promoted standby, where its key
    record never arrived: the provider still holds one charge, the answer names it, and the
    receipt job staged again has the job key the lost one had (a consumer dedupes on it)."""
    scope, key = f"lost-{uuid.uuid4().hex[:12]}", "ride-1"
    with pgcluster.cluster(pg_template) as cluster:
        cluster.lag()
        first = answer(engine, engine_url(cluster), provider, scope, key)
        assert (first.status, charges(provider, scope, key)) == (201, 1)
        staged = cluster.primary.query("SELECT job_key FROM staged_jobs")
        cluster.stop_immediate()
        cluster.promote()
        lost = cluster.primary.query(f"SELECT 1 FROM idempotency_keys WHERE scope = '{scope}'")
        assert not lost, "the key record survived: the standby did not lag"

        again = answer(engine, engine_url(cluster), provider, scope, key)
        staged_again = cluster.primary.query("SELECT job_key FROM staged_jobs")

    assert again.status == 201
    assert charges(provider, scope, key) == 1
    assert again.body["charge_id"] == first.body["charge_id"]
    assert len(staged) == 1
    assert staged_again == staged


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_a_libpq_multi_host_url_follows_the_primary(
    engine: str, pg_template: pgcluster.Template, provider: Provider
) -> None:
    """``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write`` is accepted, and a
    new engine on it after a promotion writes to the new primary."""
    scope = f"libpq-{uuid.uuid4().hex[:12]}"
    with pgcluster.cluster(pg_template, synchronous=True) as cluster:
        url = cluster.url()
        assert answer(engine, url, provider, scope, "before").status == 201
        cluster.stop_immediate()
        cluster.promote()
        assert answer(engine, url, provider, scope, "after").status == 201
        on_new_primary = cluster.primary.query(
            f"SELECT idempotency_key FROM idempotency_keys WHERE scope = '{scope}' ORDER BY 1"
        )
    assert on_new_primary == [("after",), ("before",)]


# -- the database down ------------------------------------------------------------------------


def told(call: Callable[[str], object]) -> object:
    """What ``call`` raised: its class's name, its HTTP status, whether it says when to
    retry."""
    try:
        call("down")
    except Exception as exc:
        retry_after = getattr(exc, "retry_after", None)
        says_when = isinstance(retry_after, int) and retry_after >= 1
        return type(exc).__name__, getattr(exc, "http_status", None), says_when
    return "nothing raised"


def test_while_the_database_is_down_every_caller_is_told_to_retry_and_then_served(
    pg_template: pgcluster.Template, provider: Provider
) -> None:
    """The primary stopped, no standby: ``rp.Engine.run``, ``rp.AsyncEngine.run``,
    ``@rp.idempotent`` and ``Engine.resume`` raise ``rp.DatabaseUnavailable`` (503, with a
    Retry-After), and HTTP clients get a 503 problem+json with Retry-After; once the server is
    back, each one's next call is served (no broken pooled connection is handed out)."""
    scope = f"down-{uuid.uuid4().hex[:12]}"
    with (
        pgcluster.cluster(pg_template, standby=False) as cluster,
        engines(cluster.primary.url(), provider) as calls,
    ):
        engine = rp.Engine(cluster.primary.url())
        gates = http_apps.Gates()
        order = http_apps.order_operation(gates)
        engine.register(order)

        @rp.idempotent(engine, key="key", name=f"pay_{scope}")
        def pay(key: str, amount: int) -> int:
            return amount

        try:
            with (
                serve_asgi(http_apps.fastapi_app(engine, order, gates)) as fastapi_url,
                serve_wsgi(http_apps.flask_app(engine, order, gates)) as flask_url,
            ):
                routes = {
                    "fastapi-sync": f"{fastapi_url}/sync/orders",
                    "fastapi-async": f"{fastapi_url}/async/orders",
                    "flask": f"{flask_url}/sync/orders",
                }

                def post(route: str, key: str) -> httpx.Response:
                    headers = {"Idempotency-Key": f"{route}-{key}", "X-Tenant": scope}
                    return httpx.post(
                        routes[route], json={"item": key}, headers=headers, timeout=60
                    )

                assert {
                    route: post(route, "before").status_code for route in routes
                } == dict.fromkeys(routes, 201)
                key_id = cluster.primary.value(
                    f"SELECT min(id) FROM idempotency_keys WHERE scope = '{scope}'"
                )
                callers: dict[str, Callable[[str], object]] = {
                    "rp.Engine.run": lambda key: calls["sync"](scope, key),
                    "rp.AsyncEngine.run": lambda key: calls["async"](scope, key),
                    "@rp.idempotent": lambda key: pay(key=key, amount=1),
                    "Engine.resume": lambda key: engine.resume(key_id),
                }
                for call in callers.values():
                    call("before")  # each pool holds a connection to the server

                cluster.primary.stop("immediate")
                raised = {name: told(call) for name, call in callers.items()}
                answered = {route: post(route, "down") for route in routes}

                cluster.primary.start()
                served_after = {name: call("after") is not None for name, call in callers.items()}
                replies_after = {route: post(route, "after").status_code for route in routes}
        finally:
            engine.dispose()

    assert raised == dict.fromkeys(callers, ("DatabaseUnavailable", 503, True))
    assert {
        route: (
            r.status_code,
            r.headers.get("content-type", "").split(";")[0],
            r.headers.get("retry-after", "").isdigit(),
        )
        for route, r in answered.items()
    } == dict.fromkeys(routes, (503, "application/problem+json", True))
    assert served_after == dict.fromkeys(callers, True)
    assert replies_after == dict.fromkeys(routes, 201)


# -- the primary's connections killed, the primary restarted -----------------------------------


def test_backend_kill_storms(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    """pg_terminate_backend on every client backend, every 0.5 s (and after some progress)
    for 3 s."""
    killed = []

    def storms(cluster: pgcluster.Cluster, clients: Load) -> float:
        for _ in range(6):
            storm = time.monotonic()
            killed.append(cluster.terminate_backends())
            clients.wait_for_successes(1, after=storm)
            time.sleep(max(0.0, storm + 0.5 - time.monotonic()))  # the storms' pace
        return storm

    made = pgcluster.cluster(pg_template, standby=False)
    scenario("pg_terminate_backend storms", request, provider, made, storms)
    assert sum(killed) > 0


def test_a_postgresql_restart(
    pg_template: pgcluster.Template, provider: Provider, request: pytest.FixtureRequest
) -> None:
    """The primary crashes (immediate shutdown) and starts again."""

    def restart(cluster: pgcluster.Cluster, clients: Load) -> float:
        cluster.restart()
        return time.monotonic()  # it answers again

    made = pgcluster.cluster(pg_template, standby=False)
    scenario("PostgreSQL restart", request, provider, made, restart)


# -- PgBouncer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pooled(
    pg_template: pgcluster.Template,
) -> Iterator[tuple[pgcluster.Cluster, pgcluster.PgBouncer]]:
    """A primary behind Debian's PgBouncer in transaction pooling mode."""
    with (
        pgcluster.cluster(pg_template, standby=False) as cluster,
        pgcluster.pgbouncer(cluster.primary) as bouncer,
    ):
        yield cluster, bouncer


def reconnect(bouncer: pgcluster.PgBouncer) -> None:
    """Each server connection is closed once released; new ones are opened."""
    bouncer.admin("RECONNECT")


def pause_and_resume(bouncer: pgcluster.PgBouncer) -> None:
    """Clients wait while every server connection is released, then carry on."""
    bouncer.admin("PAUSE")
    bouncer.admin("RESUME")


def kill(bouncer: pgcluster.PgBouncer) -> None:
    """Every client and server connection of the database dropped at once."""
    bouncer.admin(f"KILL {pgcluster.DATABASE}")
    bouncer.admin(f"RESUME {pgcluster.DATABASE}")


ADMIN_COMMANDS = {"RECONNECT": reconnect, "PAUSE-RESUME": pause_and_resume, "KILL": kill}


@pytest.mark.parametrize("command", ADMIN_COMMANDS)
def test_pgbouncer_admin_commands(
    command: str,
    pooled: tuple[pgcluster.Cluster, pgcluster.PgBouncer],
    provider: Provider,
    request: pytest.FixtureRequest,
) -> None:
    cluster, bouncer = pooled

    def admin(cluster: pgcluster.Cluster, clients: Load) -> float:
        # Timed from when the command is done (KILL's RESUME included): a request that was
        # answered while it was on its way is no success after it.
        ADMIN_COMMANDS[command](bouncer)
        return time.monotonic()

    made = nullcontext(cluster)
    scenario(f"PgBouncer {command}", request, provider, made, admin, url=lambda _: bouncer.url())


@pytest.mark.parametrize("setting", [None, True])
def test_behind_pgbouncer_nothing_is_prepared_unless_the_engine_is_told(
    pooled: tuple[pgcluster.Cluster, pgcluster.PgBouncer], setting: bool | None
) -> None:
    # PgBouncer 1.18 hands each transaction to any server connection: a connection through
    # it is told apart from one to PostgreSQL itself, and nothing is prepared on it (the
    # load above shows what preparing there costs: 26000, 42P05, 08P01). Told it keeps
    # prepared statements (PgBouncer 1.21 on), the engine prepares as it does elsewhere.
    cluster, bouncer = pooled
    for url, through_pooler in ((bouncer.url(), True), (cluster.primary.url(), False)):
        engine = rp.Engine(url, prepared_statements=setting)
        pooled_connection = engine.db.raw_connection()
        try:
            driver: Any = pooled_connection.driver_connection
            unprepared = _pooler.UNPREPARED in pooled_connection.info
            assert unprepared == (through_pooler and setting is None)
            assert (driver.prepare_threshold is None) == unprepared
        finally:
            pooled_connection.close()
            engine.dispose()
