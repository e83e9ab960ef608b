"""The retrying client against a real HTTP server on loopback that fails on purpose, and its
retry policy on its own (a fake clock, a seeded random generator)."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from statistics import mean
from types import SimpleNamespace

import httpx
import pytest
from http_servers import serve_asgi
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from recoverypoint import NeedsReconciliation
from recoverypoint import client as client_module
from recoverypoint.client import AsyncClient, Attempts, Client, Retry, RetryPolicy, _headers
from recoverypoint.integrations._problem import problem_reply

FAST = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05, total_timeout=30)


class Dropped(Response):
    """Promise a body, then end without it: the server drops the connection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]}
        )


class Script:
    """``POST /script/<plan>``: the n-th attempt under a key gets the plan's n-th answer
    (``503``, ``503:1`` with ``Retry-After: 1``, ``drop``...), then 200; ``ok`` is no failure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[str, list[float]] = defaultdict(list)
        self.keys: list[str | None] = []

    async def endpoint(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key")
        with self.lock:
            self.keys.append(key)
            self.attempts[key or ""].append(time.monotonic())
            attempt = len(self.attempts[key or ""])
        plan = [p for p in request.path_params["plan"].split(",") if p != "ok"]
        if attempt > len(plan):
            return JSONResponse({"key": key, "attempt": attempt})
        answer = plan[attempt - 1]
        if answer == "drop":
            return Dropped()
        status, _, retry_after = answer.partition(":")
        headers = {"Retry-After": retry_after} if retry_after else {}
        return JSONResponse({"attempt": attempt}, int(status), headers)


@pytest.fixture(scope="module")
def script_server() -> Iterator[tuple[str, Script]]:
    script = Script()
    app = Starlette(routes=[Route("/script/{plan}", script.endpoint, methods=["POST"])])
    with serve_asgi(app) as base_url:
        yield base_url, script


def test_every_attempt_of_a_logical_request_carries_its_one_key(
    script_server: tuple[str, Script],
) -> None:
    base_url, script = script_server
    retries: list[Retry] = []
    with Client(base_url, policy=FAST, on_retry=retries.append) as client:
        response = client.post("/script/503,429,drop,409,500", json={"a": 1})

    assert response.status_code == 200
    key = response.json()["key"]
    assert response.json()["attempt"] == 6
    assert len(script.attempts[key]) == 6
    assert [r.status for r in retries] == [503, 429, None, 409, 500]
    assert isinstance(retries[2].error, httpx.TransportError)  # reset or cut short
    assert {r.key for r in retries} == {key}


def test_the_async_client_does_the_same(script_server: tuple[str, Script]) -> None:
    base_url, script = script_server
    retries: list[Retry] = []

    async def send() -> httpx.Response:
        async with AsyncClient(base_url, policy=FAST, on_retry=retries.append) as client:
            return await client.post("/script/503,drop,429", json={"a": 1})

    response = asyncio.run(send())
    assert response.status_code == 200
    key = response.json()["key"]
    assert len(script.attempts[key]) == 4
    assert [r.status for r in retries] == [503, None, 429]


def test_each_logical_request_has_a_new_key_unless_one_is_given(
    script_server: tuple[str, Script],
) -> None:
    base_url, _ = script_server
    with Client(base_url, policy=FAST) as client:
        first = client.post("/script/ok").json()["key"]
        second = client.post("/script/ok").json()["key"]
        given = client.post("/script/ok", idempotency_key="my-key").json()["key"]
    assert first != second
    assert given == "my-key"


@pytest.mark.slow
def test_retry_after_is_waited_for(script_server: tuple[str, Script]) -> None:
    base_url, script = script_server
    with Client(base_url, policy=FAST) as client:
        response = client.post("/script/503:1")
    first, second = script.attempts[response.json()["key"]]
    assert second - first >= 0.95  # FAST alone would wait at most 0.05 s


def test_attempts_are_bounded(script_server: tuple[str, Script]) -> None:
    base_url, script = script_server
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.01)
    with Client(base_url, policy=policy) as client:
        response = client.post("/script/" + ",".join(["503"] * 10))
    assert response.status_code == 503
    assert len(script.attempts[response.request.headers["Idempotency-Key"]]) == 3


@pytest.mark.slow
def test_total_time_is_bounded(script_server: tuple[str, Script]) -> None:
    base_url, script = script_server
    policy = RetryPolicy(max_attempts=10, base_delay=0.01, max_delay=0.01, total_timeout=1.5)
    with Client(base_url, policy=policy) as client:
        response = client.post("/script/" + ",".join(["503:1"] * 10))
    assert response.status_code == 503
    # A second wait of 1 s would end past 1.5 s: no third attempt.
    assert len(script.attempts[response.request.headers["Idempotency-Key"]]) == 2


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_other_answers_are_returned_at_once(script_server: tuple[str, Script], status: int) -> None:
    base_url, script = script_server
    with Client(base_url, policy=FAST) as client:
        response = client.post(f"/script/{status}")
    assert response.status_code == status
    assert len(script.attempts[response.request.headers["Idempotency-Key"]]) == 1


class Held:
    """``POST /held``: every request is held for reconciliation, answered with the 423
    problem the integrations send for :class:`~recoverypoint.NeedsReconciliation`."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.reconciled = False
        """Then every request is answered 201, as a reconciled key answers."""

    async def endpoint(self, request: Request) -> Response:
        self.keys.append(request.headers.get("Idempotency-Key"))
        if self.reconciled:
            return Response(b"{}", 201, {"content-type": "application/json"})
        reply = problem_reply(NeedsReconciliation(), retry_after=1)
        return Response(reply.body, reply.status, dict(reply.headers))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_held_request_is_never_sent_with_another_key(flavour: str) -> None:
    held = Held()
    app = Starlette(routes=[Route("/held", held.endpoint, methods=["POST"])])

    async def send_async(base_url: str) -> list[httpx.Response]:
        async with AsyncClient(base_url, policy=FAST) as client:
            return [
                await client.post("/held", json={"ride": 1}),
                await client.post("/held", json={"ride": 1}),
                await client.post("/held", json={"ride": 2}),
            ]

    with serve_asgi(app) as base_url:
        if flavour == "async":
            answers = asyncio.run(send_async(base_url))
        else:
            with Client(base_url, policy=FAST) as client:
                answers = [
                    client.post("/held", json={"ride": 1}),
                    client.post("/held", json={"ride": 1}),
                    client.post("/held", json={"ride": 2}),
                ]

    # Final at once (one attempt each); the same request sent again kept its key, and the
    # problem says why; another request got a key of its own.
    assert [a.status_code for a in answers] == [423] * 3 and len(held.keys) == 3
    first, again, other = held.keys
    assert first == again and other not in (None, first)
    assert "do not send the request with another key" in answers[0].json()["detail"]


def test_a_held_request_keeps_its_key_until_it_is_answered_otherwise() -> None:
    held = Held()
    app = Starlette(routes=[Route("/held", held.endpoint, methods=["POST"])])
    with serve_asgi(app) as base_url, Client(base_url, policy=FAST) as client:
        assert client.post("/held", json={"ride": 1}).status_code == 423
        held.reconciled = True  # an operator reconciled the key
        assert client.post("/held", json={"ride": 1}).status_code == 201  # its answer
        assert client.post("/held", json={"ride": 1}).status_code == 201  # a new request
    first, reconciled, new = held.keys
    assert reconciled == first and new not in (None, first)


def test_a_refused_connection_is_retried_then_raised() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    retries: list[Retry] = []
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.01)
    with (
        Client(f"http://127.0.0.1:{port}", policy=policy, on_retry=retries.append) as client,
        pytest.raises(httpx.ConnectError),
    ):
        client.post("/anything")
    assert len(retries) == 2 and len({r.key for r in retries}) == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_waits_the_client_makes_grow_and_are_jittered(
    script_server: tuple[str, Script], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The client's own sleeps, recorded instead of slept, over 20 logical requests that
    each fail 5 times: the n-th wait is drawn from 0 to min(max_delay, base_delay * 2**(n-1)),
    so waits grow on average and differ from request to request."""
    base_url, script = script_server
    waits: list[float] = []

    async def async_sleep(seconds: float) -> None:
        waits.append(seconds)

    # The client module's own `time` and `anyio`: nothing else stops sleeping.
    monkeypatch.setattr(
        client_module, "time", SimpleNamespace(sleep=waits.append, monotonic=time.monotonic)
    )
    monkeypatch.setattr(client_module, "anyio", SimpleNamespace(sleep=async_sleep))
    # Seeded: the checks below are on 20 draws per retry, which unseeded draws fail now and
    # then by chance (a mean of 20 uniform draws below 2.5 of 8, say).
    rng = random.Random(20)
    monkeypatch.setattr(
        client_module, "Attempts", lambda policy, key: Attempts(policy, key, rng=rng)
    )
    policy = RetryPolicy(max_attempts=6, base_delay=1.0, max_delay=8.0, total_timeout=3600)
    requests, plan = 20, "/script/503,503,503,503,503"

    if kind == "sync":
        with Client(base_url, policy=policy) as client:
            keys = [client.post(plan).json()["key"] for _ in range(requests)]
    else:

        async def send() -> list[str]:
            async with AsyncClient(base_url, policy=policy) as client:
                return [(await client.post(plan)).json()["key"] for _ in range(requests)]

        keys = asyncio.run(send())

    assert all(len(script.attempts[key]) == 6 for key in keys)
    assert len(waits) == requests * 5  # a wait before every retry
    by_retry = [waits[n::5] for n in range(5)]
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0]
    for ceiling, drawn in zip(ceilings, by_retry, strict=True):
        assert all(0 <= wait <= ceiling for wait in drawn)
        # Full jitter: spread over the whole range, no two alike.
        assert min(drawn) < ceiling / 2 < max(drawn)
        assert len(set(drawn)) == requests
    means = [mean(drawn) for drawn in by_retry]
    assert means[0] < means[1] < means[2] < means[3]  # about 0.5, 1, 2, 4
    assert 2.5 < means[4] < 5.5  # capped at max_delay: about 4 again


# -- the policy, without I/O -------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def attempts(policy: RetryPolicy, clock: FakeClock | None = None) -> Attempts:
    return Attempts(policy, "k", clock=clock or FakeClock(), rng=random.Random(7))


def test_delays_are_full_jitter_under_an_exponential_ceiling() -> None:
    policy = RetryPolicy(max_attempts=50, base_delay=1.0, max_delay=8.0, total_timeout=1e9)
    state = attempts(policy)
    for made in range(1, 40):
        state.begin()
        retry = state.after_response(503, None)
        assert retry is not None and retry.attempt == made
        assert 0 <= retry.delay <= min(8.0, 2.0 ** (made - 1))
    ceilings = [min(8.0, 2.0 ** (n - 1)) for n in range(1, 40)]
    assert max(ceilings) == 8.0


def test_retry_after_is_a_floor_in_seconds_or_as_a_date() -> None:
    policy = RetryPolicy(base_delay=0.01, max_delay=0.01)
    state = attempts(policy)
    state.begin()
    retry = state.after_response(429, "3")
    assert retry is not None and retry.delay == 3.0
    when = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    retry = state.after_response(503, when)
    assert retry is not None and 25 <= retry.delay <= 30
    retry = state.after_response(503, "soon")
    assert retry is not None and retry.delay <= 0.01


def test_no_retry_that_would_start_after_the_total_timeout() -> None:
    clock = FakeClock()
    state = attempts(RetryPolicy(total_timeout=10, base_delay=0.01, max_delay=0.01), clock)
    state.begin()
    clock.now += 8
    assert state.after_response(503, "1") is not None
    assert state.after_response(503, "3") is None


def test_what_is_never_retried() -> None:
    state = attempts(RetryPolicy())
    state.begin()
    assert state.after_response(200, None) is None
    assert state.after_response(422, None) is None
    assert state.after_response(500, None, replayed=True) is None  # a stored, final answer
    assert state.after_response(500, None) is not None
    assert state.after_error(httpx.UnsupportedProtocol("ftp://")) is None
    assert state.after_error(httpx.ReadTimeout("slow")) is not None


class MedianRandom(random.Random):
    """Jitter at its mean: the wait a default client makes on average."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


def test_by_default_a_server_away_for_20_seconds_is_waited_for() -> None:
    clock = FakeClock()
    state = Attempts(RetryPolicy(), "k", clock=clock, rng=MedianRandom())
    waited = 0.0
    while True:
        state.begin()
        retry = state.after_error(httpx.ConnectError("refused"))
        if retry is None:
            break
        clock.now += retry.delay
        waited += retry.delay
    assert waited >= 20.0
    assert waited <= RetryPolicy().total_timeout


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize(
    "headers",
    [{"Authorization": "Bearer …"}, [("Authorization", "Bearer é")], {"X-Naïve": "yes"}],
)
def test_a_header_that_is_not_ascii_is_named_before_anything_is_sent(
    script_server: tuple[str, Script], kind: str, headers: object
) -> None:
    base_url, script = script_server
    sent_before = len(script.keys)
    with pytest.raises(ValueError, match=r"header 'X-Naïve'|header 'Authorization'") as caught:
        if kind == "sync":
            with Client(base_url, policy=FAST) as client:
                client.post("/script/200", headers=headers)
        else:

            async def send() -> None:
                async with AsyncClient(base_url, policy=FAST) as client:
                    await client.post("/script/200", headers=headers)

            asyncio.run(send())
    assert "U+" in str(caught.value) and "ASCII" in str(caught.value)
    assert len(script.keys) == sent_before


def test_default_headers_are_checked_too() -> None:
    with pytest.raises(ValueError, match="header 'Authorization'"):
        Client("http://127.0.0.1:1", headers={"Authorization": "Bearer …"})


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20), max_size=4))
def test_any_header_text_is_sent_or_refused_with_a_value_error(headers: dict[str, str]) -> None:
    try:
        built = _headers(headers)
    except ValueError:
        assert any(not (k.isascii() and v.isascii()) for k, v in headers.items())
    else:
        assert len(built) <= len(headers)
