"""src/recoverypoint/demo/rocket_rides as a user runs it: ``python -m
recoverypoint.demo.rocket_rides`` processes (migrate, the fake provider, the API, the
simulator) on loopback, on a database of their own.

Three provider/API pairs share that database: a healthy one (slowed by 200 ms, so that
concurrent requests overlap), one whose provider fails after every new charge, and one
whose provider always fails before charging.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import http_servers
import httpx
import pytest
import sqlalchemy as sa
from ports import free_port
from rides import count

from recoverypoint.client import Client, Retry, RetryPolicy
from recoverypoint.database import create_engine

pytestmark = [
    pytest.mark.slow,  # twelve processes, the API and its providers on both engines
    pytest.mark.xdist_group("rocket_rides"),  # started once for the module
]

ROOT = Path(__file__).resolve().parents[1]
ALICE, DECLINED = "alice@example.com", "declined@example.com"
RIDE = {"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.79, "target_lon": -122.40}
FAST = RetryPolicy(max_attempts=6, base_delay=0.05, max_delay=0.2, total_timeout=60)


@dataclass
class Service:
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text()


def _example(*args: str) -> list[str]:
    return [sys.executable, "-m", "recoverypoint.demo.rocket_rides", *args]


def _start(
    stack: ExitStack, tmp: Path, name: str, *args: str, by_port: bool = False
) -> tuple[Service, subprocess.Popen[bytes]]:
    """Start a process of the example, on a socket already listening, handed over (a port
    merely found free can be taken by another process's outgoing connection before the
    server binds it), or ``by_port``, as docs/how-to/rocket-rides.md starts it, on a port
    from outside the ephemeral range."""
    log = tmp / f"{name}.log"
    out = stack.enter_context(log.open("wb"))
    fds: tuple[int, ...] = ()
    if by_port:
        port = free_port()
        where = ["--port", str(port)]
    else:
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=128))
        port, fds = listener.getsockname()[1], (listener.fileno(),)
        where = ["--fd", str(listener.fileno())]
    proc = subprocess.Popen(_example(*args, *where), cwd=ROOT, stdout=out, stderr=out, pass_fds=fds)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)
    return Service(f"http://127.0.0.1:{port}", log), proc


def _wait_ready(service: Service, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600  # a process starting on a busy machine; only a hang fails
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{service.log.name} exited:\n{service.log_text()}")
        try:
            http_servers.client.get(service.url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{service.log.name} did not start:\n{service.log_text()}")


@pytest.fixture(scope="module")
def rr_db(module_database_url: str) -> Iterator[sa.Engine]:
    migrated = subprocess.run(
        _example("migrate", "--database-url", module_database_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "Rocket Rides tables are ready" in migrated.stdout
    engine = create_engine(module_database_url)
    yield engine
    engine.dispose()


ENGINES = ["Engine", "AsyncEngine"]


@pytest.fixture(scope="module")
def every_service(
    rr_db: sa.Engine, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, Service]]]:
    """The API on ``rp.Engine`` and on ``rp.AsyncEngine`` (``api --async``), each before
    a provider of its own per fault, started together once for the module: a module
    fixture with params would rely on pytest keeping each param's tests together, which it
    does not promise (in the whole suite it alternated them, starting the six processes
    for each test)."""
    tmp = tmp_path_factory.mktemp("rocket_rides")
    db = ["--database-url", module_database_url]
    faults = {
        "healthy": ["--latency-ms", "200"],
        "fails_after_charge": ["--fail-after-charge-rate", "1"],
        "fails": ["--fail-rate", "1"],
    }
    with ExitStack() as stack:
        started: dict[str, dict[str, tuple[Service, subprocess.Popen[bytes]]]] = {}
        for engine in ENGINES:
            on_async = ["--async"] if engine == "AsyncEngine" else []
            ours = started[engine] = {}
            for name, knobs in faults.items():
                # The how-to's --port, once; --fd, which the demo uses, for the others.
                by_port = engine == "Engine" and name == "healthy"
                provider = _start(
                    stack,
                    tmp,
                    f"{engine}-{name}-provider",
                    "provider",
                    *db,
                    *knobs,
                    by_port=by_port,
                )
                ours[f"{name}-provider"] = provider
                ours[name] = _start(
                    stack,
                    tmp,
                    f"{engine}-{name}-api",
                    "api",
                    *db,
                    "--provider-url",
                    provider[0].url,
                    *on_async,
                    by_port=by_port,
                )
        for ours in started.values():
            for service, proc in ours.values():
                _wait_ready(service, proc)
        yield {
            engine: {name: service for name, (service, _) in ours.items()}
            for engine, ours in started.items()
        }


@pytest.fixture(params=ENGINES)
def services(
    request: pytest.FixtureRequest, every_service: dict[str, dict[str, Service]]
) -> dict[str, Service]:
    """Each test runs against the API on ``rp.Engine``, then on ``rp.AsyncEngine``."""
    return every_service[request.param]


def book(
    api: Service, key: str | None, email: str | None = ALICE, body: Any = RIDE
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {email}"} if email else {}
    if key is not None:
        headers["Idempotency-Key"] = key
    return http_servers.client.post(f"{api.url}/rides", json=body, headers=headers, timeout=30)


def key_count(db: sa.Engine, key: str) -> int:
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = :k", k=key)


def test_a_ride_is_booked_charged_receipted_and_replayed(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    first = book(services["healthy"], key)
    again = book(services["healthy"], key)

    assert first.status_code == 201, first.text
    ride_id, charge_id = first.json()["ride_id"], first.json()["charge_id"]
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    with rr_db.connect() as conn:
        ride = conn.execute(sa.text("SELECT * FROM rides WHERE id = :i"), {"i": ride_id}).one()
        audit = conn.execute(
            sa.text("SELECT * FROM audit_records WHERE resource_id = :i"), {"i": ride_id}
        ).one()
        charge = conn.execute(
            sa.text("SELECT * FROM provider_charges WHERE id = :c"), {"c": charge_id}
        ).one()
        job = conn.execute(
            sa.text("SELECT * FROM staged_jobs WHERE idempotency_key_id = :k"),
            {"k": ride.idempotency_key_id},
        ).one()
    assert ride.charge_id == charge_id
    assert (audit.action, audit.resource_type, str(audit.origin_ip)) == (
        "ride.created",
        "ride",
        "127.0.0.1/32",
    )
    assert (charge.amount, charge.currency, charge.customer) == (2000, "usd", "cus_alice")
    assert charge.idempotency_key.startswith("rp_")  # the downstream key, not the client's
    assert job.job_name == "send_ride_receipt"
    assert job.job_args == {
        "ride_id": ride_id,
        "user_id": ride.user_id,
        "amount": 2000,
        "currency": "usd",
    }


def test_a_declined_card_is_a_stored_402(services: dict[str, Service], rr_db: sa.Engine) -> None:
    key = str(uuid.uuid4())
    first = book(services["healthy"], key, DECLINED)
    again = book(services["healthy"], key, DECLINED)

    assert first.status_code == 402
    assert first.json()["error"] == "card_declined"
    assert again.status_code == 402 and again.headers["idempotent-replayed"] == "true"
    assert (
        count(rr_db, "SELECT count(*) FROM provider_charges WHERE customer = 'cus_declined'") == 0
    )


@pytest.mark.parametrize(
    ("email", "body", "status"),
    [
        (None, RIDE, 401),
        ("nobody@example.com", RIDE, 401),
        (ALICE, {**RIDE, "origin_lat": 200}, 422),
        (ALICE, {"origin_lat": 1}, 422),
    ],
    ids=["no-auth", "unknown-user", "bad-latitude", "missing-fields"],
)
def test_refused_requests_store_nothing(
    services: dict[str, Service], rr_db: sa.Engine, email: str | None, body: Any, status: int
) -> None:
    key = str(uuid.uuid4())
    rides = count(rr_db, "SELECT count(*) FROM rides")
    assert book(services["healthy"], key, email, body).status_code == status
    assert key_count(rr_db, key) == 0
    assert count(rr_db, "SELECT count(*) FROM rides") == rides


def test_a_missing_key_is_a_400(services: dict[str, Service]) -> None:
    response = book(services["healthy"], None)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"


def test_concurrent_duplicates_book_one_ride(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: book(services["healthy"], key), range(6)))

    fresh = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(fresh) == 1
    for answer in answers:
        assert answer.status_code in (201, 409), answer.text
        if answer.status_code == 409:
            assert "retry-after" in answer.headers
        elif answer is not fresh[0]:
            assert answer.json() == fresh[0].json()
    assert (
        count(
            rr_db,
            "SELECT count(*) FROM rides r JOIN idempotency_keys k "
            "ON k.id = r.idempotency_key_id WHERE k.idempotency_key = :k",
            k=key,
        )
        == 1
    )


def test_a_provider_failing_after_the_charge_never_charges_twice(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    retries: list[Retry] = []
    headers = {"Authorization": f"Bearer {ALICE}"}
    rides_before = count(rr_db, "SELECT count(*) FROM rides")
    charges_before = count(rr_db, "SELECT count(*) FROM provider_charges")
    with Client(services["fails_after_charge"].url, policy=FAST, on_retry=retries.append) as client:
        # Two rides: the provider fails the first new charge with a 500 and drops the
        # connection on the second (or the other way round).
        answers = [client.post("/rides", json=RIDE, headers=headers) for _ in range(2)]

    for answer in answers:
        assert answer.status_code == 201, answer.text
        charge_id = answer.json()["charge_id"]
        with rr_db.connect() as conn:
            key = conn.scalar(
                sa.text("SELECT idempotency_key FROM provider_charges WHERE id = :c"),
                {"c": charge_id},
            )
        assert (
            count(rr_db, "SELECT count(*) FROM provider_charges WHERE idempotency_key = :k", k=key)
            == 1
        )
        assert count(rr_db, "SELECT count(*) FROM rides WHERE charge_id = :c", c=charge_id) == 1
    assert [r.status for r in retries] == [503, 503]
    # Nothing was created twice: each retry resumed its own request.
    assert count(rr_db, "SELECT count(*) FROM rides") == rides_before + 2
    assert count(rr_db, "SELECT count(*) FROM provider_charges") == charges_before + 2
    log = services["fails_after_charge-provider"].log_text()
    assert "then error" in log and "then drop" in log


def test_the_client_gets_the_same_charge_when_the_provider_drops_the_connection(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    retries: list[Retry] = []
    provider = services["fails_after_charge-provider"].url
    charge = {"amount": 500, "currency": "usd", "customer": "cus_direct"}
    with Client(provider, policy=FAST, on_retry=retries.append) as client:
        answers = [client.post("/charges", json=charge) for _ in range(2)]

    assert [a.status_code for a in answers] == [200, 200]
    assert sorted(str(r.status) for r in retries) == ["500", "None"]  # one of each
    assert any(isinstance(r.error, httpx.TransportError) for r in retries)
    for answer in answers:
        key = answer.request.headers["Idempotency-Key"]
        with rr_db.connect() as conn:
            ids = conn.scalars(
                sa.text("SELECT id FROM provider_charges WHERE idempotency_key = :k"), {"k": key}
            ).all()
        assert ids == [answer.json()["id"]]


def test_a_failing_provider_is_a_503_and_a_retry_resumes_where_it_stopped(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    failed = book(services["fails"], key)

    assert failed.status_code == 503
    assert failed.headers["content-type"] == "application/problem+json"
    assert int(failed.headers["retry-after"]) >= 1
    with rr_db.connect() as conn:
        point = conn.scalar(
            sa.text("SELECT recovery_point FROM idempotency_keys WHERE idempotency_key = :k"),
            {"k": key},
        )
    assert point == "ride_created"
    # The same request, once the provider is back (the healthy API shares the database).
    resumed = book(services["healthy"], key)
    assert resumed.status_code == 201, resumed.text
    assert (
        count(
            rr_db,
            "SELECT count(*) FROM rides r JOIN idempotency_keys k "
            "ON k.id = r.idempotency_key_id WHERE k.idempotency_key = :k",
            k=key,
        )
        == 1
    )


def test_the_simulator_books_rides_through_faults(
    services: dict[str, Service], rr_db: sa.Engine
) -> None:
    ran = subprocess.run(
        _example(
            "simulate",
            "--api-url",
            services["fails_after_charge"].url,
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--seed",
            "1",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "6 requests: 5 x 201, 1 x 402" in ran.stdout
    assert "[Idempotent-Replayed: true]" in ran.stdout
    orphans = count(
        rr_db,
        "SELECT count(*) FROM provider_charges p LEFT JOIN rides r ON r.charge_id = p.id "
        "WHERE r.id IS NULL AND p.customer = 'cus_alice'",
    )
    assert orphans == 0
