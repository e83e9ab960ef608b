"""A single-step endpoint that declares its provider's dedupe window: a retry of an
unfinished key after the window never runs the endpoint blindly again; it answers 423
(needs reconciliation), and so does every later retry, until an operator reconciles it.
FastAPI and Flask over real HTTP servers; time moved with testing.Clock on a database of
the test's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta

import flask
import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from http_servers import serve_asgi, serve_wsgi

import recoverypoint as rp
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.integrations import flask as rp_flask
from recoverypoint.testing import Clock

WINDOW = timedelta(hours=24)


class Provider:
    """Counts the calls; the first one's answer is lost (the endpoint fails after it)."""

    def __init__(self) -> None:
        self.calls = 0

    def charge(self) -> dict[str, int]:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("the provider's answer was lost")
        return {"charge": self.calls}


def fastapi_server(engine: rp.Engine, provider: Provider) -> AbstractContextManager[str]:
    idempotency = rp_fastapi.Idempotency(engine, scope=UNSCOPED)
    app = FastAPI()
    app.add_middleware(rp_fastapi.SingleStepMiddleware)

    @app.post("/charges", status_code=201)
    @idempotency.single_step("charge_fastapi", dedupe_window=WINDOW)
    def charge() -> dict[str, int]:
        return provider.charge()

    return serve_asgi(app)


def flask_server(engine: rp.Engine, provider: Provider) -> AbstractContextManager[str]:
    idempotency = rp_flask.Idempotency(engine, scope=UNSCOPED)
    app = flask.Flask("windows")

    @app.post("/charges")
    @idempotency.single_step("charge_flask", dedupe_window=WINDOW)
    def charge() -> tuple[dict[str, int], int]:
        return provider.charge(), 201

    return serve_wsgi(app)


SERVERS: dict[str, Callable[[rp.Engine, Provider], AbstractContextManager[str]]] = {
    "fastapi": fastapi_server,
    "flask": flask_server,
}


@pytest.fixture(params=sorted(SERVERS))
def served(request: pytest.FixtureRequest, worker_db: sa.Engine) -> Iterator[tuple[str, Provider]]:
    provider = Provider()
    with SERVERS[request.param](rp.Engine(worker_db), provider) as base_url:
        yield base_url, provider


def charge(base_url: str) -> httpx.Response:
    return httpx.post(f"{base_url}/charges", headers={"Idempotency-Key": "k-1"}, json={})


@pytest.mark.slow
def test_past_the_window_a_retry_answers_423_and_runs_nothing(
    served: tuple[str, Provider], worker_db: sa.Engine
) -> None:
    base_url, provider = served
    assert charge(base_url).status_code == 500  # charged; its answer lost
    Clock(worker_db).advance(WINDOW)
    for _ in range(2):
        held = charge(base_url)
        assert held.status_code == 423
        assert held.headers["content-type"].startswith("application/problem+json")
    assert provider.calls == 1


@pytest.mark.slow
def test_inside_the_window_a_retry_runs_the_endpoint_again(
    served: tuple[str, Provider], worker_db: sa.Engine
) -> None:
    base_url, provider = served
    assert charge(base_url).status_code == 500
    Clock(worker_db).advance(WINDOW - timedelta(minutes=1))
    assert charge(base_url).status_code == 201
    assert provider.calls == 2
