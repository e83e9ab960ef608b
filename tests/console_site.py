"""What the console tests share: a database with keys in every state, an authorizer with
three kinds of visitor, and the console mounted in a FastAPI app as users mount it.

The visitor's kind comes from a ``role`` cookie (or an ``X-Role`` header): ``operator``
may do everything, ``viewer`` only look, ``revealer`` look and unmask. Anyone else is
nobody, and the authorizer refuses them everything.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from starlette.requests import Request
from testclient import TestClient
from workload import SCHEMA, Recorder, steps_operation

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.console import ACTIONS, REVEAL, VIEW, console
from recoverypoint.database import create_engine

MOUNT = "/recoverypoint"
ROLES = {
    "operator": set(ACTIONS),
    "viewer": {VIEW},
    "revealer": {VIEW, REVEAL},
}
# What a page must never show: a query, a traceback, the driver's words.
LEAKS = re.compile(
    r"Traceback|SELECT |INSERT |UPDATE |FROM idempotency_keys|psycopg|sqlalchemy|File \""
)


def authorize(request: Request, action: str) -> str | None:
    role = request.headers.get("x-role") or request.cookies.get("role") or ""
    return f"{role}-user" if action in ROLES.get(role, set()) else None


class Provider:
    """The payment API the test operation's foreign step calls: up or down."""

    def __init__(self) -> None:
        self.down = False

    def call(self) -> None:
        if self.down:
            raise RuntimeError("payments API down")


def engine_for(db: sa.Engine, provider: Provider) -> rp.Engine:
    """An engine with ``charges`` (reserved → charged → finished): its step fails while
    the provider is down."""
    engine = rp.Engine(db)
    engine.register(steps_operation("charges", Recorder(db, on_step=provider.call)))
    return engine


def app_for(engine: rp.Engine | Any, **options: Any) -> FastAPI:
    """The documented mount (docs/how-to/operating.md), in spirit: a FastAPI app with the
    console in it."""
    app = FastAPI()
    app.mount(MOUNT, console(engine, authorize=options.get("authorize", authorize)))
    return app


def client(app: Any, role: str | None = None) -> TestClient:
    headers = {"origin": "http://testserver"}
    if role:
        headers["x-role"] = role
    return TestClient(
        app,
        base_url="http://testserver",
        headers=headers,
        raise_server_exceptions=True,
        follow_redirects=False,
    )


def csrf_token(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


@contextmanager
def console_database(url: str) -> Iterator[sa.Engine]:
    """An engine on the database at ``url``, migrated, with the worker tests' tables."""
    migrate.upgrade(url)
    engine = create_engine(url, pool_size=5, max_overflow=10)
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    try:
        yield engine
    finally:
        engine.dispose()


# -- fixtures --------------------------------------------------------------------------------


def module_fixtures() -> tuple[Any, Any, Any]:
    """The fixtures a console test module binds at its top: ``db, provider, engine =
    module_fixtures()`` (a database of the module's own, migrated; the payment API; an
    engine with the ``charges`` operation)."""

    @pytest.fixture(scope="module")
    def db(module_database_url: str) -> Iterator[sa.Engine]:
        with console_database(module_database_url) as engine:
            yield engine

    @pytest.fixture(scope="module")
    def provider() -> Provider:
        return Provider()

    @pytest.fixture(scope="module")
    def engine(db: sa.Engine, provider: Provider) -> rp.Engine:
        return engine_for(db, provider)

    return db, provider, engine
