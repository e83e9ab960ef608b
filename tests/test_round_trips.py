"""How many times a request waits on PostgreSQL: counted at the socket, by a proxy between
the engine and the server. A round trip is the client writing after the server wrote.

A fresh key of the Rocket Rides shape (atomic phase of two statements, foreign step, atomic
phase of one statement staging a job) costs 8: the replay lookup; BEGIN with the claim; two
statements; the point with COMMIT; BEGIN with the fence; one statement; the response and
the jobs with COMMIT. A replay costs 1. A first ``@idempotent`` call costs 4 on either
engine: the lookup; BEGIN with the claim; its COMMIT; BEGIN with the answer's write (its
fence too, as the answer sends nothing) and COMMIT. The engine's statements go through
libpq, prepared once per connection, BEGIN and COMMIT in the same pipeline as the statement
beside them (see recoverypoint.engine._libpq). Structure, not speed: the numbers are exact.
"""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

import recoverypoint as rp
from recoverypoint.database import create_engine


class CountingProxy:
    """A TCP proxy to the test server that counts request/response turns."""

    def __init__(self, upstream: tuple[str, Any]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.round_trips = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept)]
        self._threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            family, address = self.upstream
            server = socket.socket(family, socket.SOCK_STREAM)
            server.connect(address)
            pump = threading.Thread(target=self._pump, args=(client, server))
            self._threads.append(pump)
            pump.start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        selector = selectors.DefaultSelector()  # closed with the sockets
        selector.register(client, selectors.EVENT_READ, server)
        selector.register(server, selectors.EVENT_READ, client)
        server_spoke_last = True
        with client, server, selector:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.2):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        return
                    if source is client and server_spoke_last:
                        with self._lock:
                            self.round_trips += 1
                    server_spoke_last = source is server
                    key.data.sendall(data)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.listener.close()


@pytest.fixture
def proxied(database_url: str, business_tables: None) -> Iterator[tuple[URL, CountingProxy]]:
    """The session's database, reached through a :class:`CountingProxy`."""
    url = make_url(database_url)
    if url.host:
        upstream: tuple[str, Any] = (socket.AF_INET, (url.host, url.port or 5432))
    else:  # the embedded server listens on a socket in the directory named by ?host=
        directory = url.query["host"]
        upstream = (socket.AF_UNIX, f"{directory}/.s.PGSQL.{url.port or 5432}")
    proxy = CountingProxy(upstream)
    try:
        yield url.set(host="127.0.0.1", port=proxy.port, query={}), proxy
    finally:
        proxy.close()


@pytest.fixture
def proxied_engine(proxied: tuple[URL, CountingProxy]) -> Iterator[tuple[rp.Engine, Any]]:
    url, proxy = proxied
    db = create_engine(url, pool_size=1, max_overflow=0)
    try:
        yield rp.Engine(db), proxy
    finally:
        db.dispose()


def rides_operation() -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation("counted_ride")

    @op.atomic_phase("ride_created")
    def create(tx: rp.AtomicContext, params: Any) -> None:
        row = tx.execute(
            "INSERT INTO rides (key_id, scope) VALUES (%(k)s, %(s)s) RETURNING id",
            {"k": tx.key_id, "s": params["scope"]},
        ).fetchone()
        assert row is not None
        tx.state["ride_id"] = row[0]
        tx.execute(
            "INSERT INTO audit_records (scope, action, key_id) VALUES (%s, 'ride', %s)",
            (params["scope"], tx.key_id),
        )

    @op.foreign_step("charge_created")
    def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {"charge_id": "ch_" + step.downstream_key()[-8:]}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "UPDATE rides SET charge_id = %s WHERE id = %s",
            (tx.state["charge_id"], tx.state["ride_id"]),
        )
        tx.stage_job("send_receipt", {"ride_id": tx.state["ride_id"]})
        return rp.Response(201, {"ride_id": tx.state["ride_id"]})

    return op


def test_a_fresh_key_costs_eight_round_trips_and_a_replay_one(
    proxied_engine: tuple[rp.Engine, CountingProxy], db: sa.Engine, scope: str
) -> None:
    engine, proxy = proxied_engine
    op = rides_operation()
    engine.register(op)
    engine.run(op, key="warm-up", params={"scope": scope}, scope=scope)  # connects

    proxy.round_trips = 0
    first = engine.run(op, key="k", params={"scope": scope}, scope=scope)
    fresh = proxy.round_trips
    proxy.round_trips = 0
    replay = engine.run(op, key="k", params={"scope": scope}, scope=scope)

    assert (first.status, first.replayed, replay.replayed) == (201, False, True)
    assert (fresh, proxy.round_trips) == (8, 1)
    with db.connect() as conn:
        jobs = conn.execute(
            sa.text("SELECT count(*) FROM staged_jobs WHERE job_name = 'send_receipt'")
        ).scalar_one()
    assert jobs >= 2  # the warm-up's and this request's, committed with their phases


def test_a_first_idempotent_call_costs_four_round_trips_and_a_replay_one(
    proxied_engine: tuple[rp.Engine, CountingProxy], db: sa.Engine
) -> None:
    # The lookup; BEGIN with the claim; its COMMIT (the body runs outside any
    # transaction); BEGIN with the answer's write, its fence, and COMMIT.
    engine, proxy = proxied_engine
    calls: list[str] = []

    @rp.idempotent(engine, key="order_id", name="counted_order")
    def place(order_id: str) -> dict[str, str]:
        calls.append(order_id)
        return {"order": order_id}

    place("warm-up")  # connects
    proxy.round_trips = 0
    first = place("o-1")
    fresh, proxy.round_trips = proxy.round_trips, 0
    replay = place("o-1")

    assert first == replay == {"order": "o-1"}
    assert (fresh, proxy.round_trips) == (4, 1)
    assert calls == ["warm-up", "o-1"]
    with db.connect() as conn:
        status = conn.execute(
            sa.text(
                "SELECT response_status FROM idempotency_keys "
                "WHERE operation = 'counted_order' AND idempotency_key = 'o-1'"
            )
        ).scalar_one()
    assert status == 200


def test_a_first_async_idempotent_call_costs_four_round_trips_and_a_replay_one(
    proxied: tuple[URL, CountingProxy],
) -> None:
    url, proxy = proxied
    calls: list[str] = []

    async def main() -> tuple[int, int]:
        engine = rp.AsyncEngine(url.render_as_string(hide_password=False))
        try:

            @rp.idempotent(engine, key="order_id", name="counted_order_async")
            async def place(order_id: str) -> dict[str, str]:
                calls.append(order_id)
                return {"order": order_id}

            await place("warm-up")  # connects
            proxy.round_trips = 0
            first = await place("o-1")
            fresh, proxy.round_trips = proxy.round_trips, 0
            replay = await place("o-1")
            assert first == replay == {"order": "o-1"}
            return fresh, proxy.round_trips
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == (4, 1)
    assert calls == ["warm-up", "o-1"]
