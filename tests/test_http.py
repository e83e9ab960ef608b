"""The FastAPI and Flask integrations over real HTTP on loopback: uvicorn serves the FastAPI
app, werkzeug's threaded server the Flask one, both on the session's PostgreSQL.

Most tests run once per route: the phased operation from a sync FastAPI route, an async one
and a Flask view, and the single-step endpoint in the same three forms. The single-step
tests further down use the other endpoints of ``http_apps``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import flask
import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from http_apps import (
    EXACT_BODIES,
    SCHEMA,
    SECRET,
    Gates,
    Order,
    content_digest,
    fastapi_app,
    flask_app,
    order_operation,
)
from http_servers import client, serve_asgi, serve_wsgi
from hypothesis import given, settings
from hypothesis import strategies as st
from rides import count
from starlette.requests import Request
from werkzeug.test import EnvironBuilder, run_wsgi_app

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.integrations import fastapi as rp_fastapi

pytestmark = pytest.mark.xdist_group("http")  # its servers, started once for the module

PHASED = ["fastapi/sync/orders", "fastapi/async/orders", "flask/sync/orders"]
SINGLE = ["fastapi/sync/single", "fastapi/async/single", "flask/sync/single"]
ALL = PHASED + SINGLE
PROBLEM = "application/problem+json"
RETRY_TEXT = "Retry it with the same Idempotency-Key"


@pytest.fixture(scope="module")
def gates() -> Gates:
    return Gates()


@pytest.fixture(scope="module")
def http_engine(db: sa.Engine) -> rp.Engine:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    return rp.Engine(db)


@pytest.fixture(scope="module")
def apps(http_engine: rp.Engine, gates: Gates) -> tuple[FastAPI, flask.Flask]:
    op = order_operation(gates)
    http_engine.register(op)
    return fastapi_app(http_engine, op, gates), flask_app(http_engine, op, gates)


class Served:
    """The FastAPI app, counting the requests it has served to the end, per tenant: what a
    request runs after its answer (its background tasks) has run by then."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._done: dict[str, int] = {}
        self._changed = threading.Condition()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                tenant = dict(scope["headers"]).get(b"x-tenant", b"").decode()
                with self._changed:
                    self._done[tenant] = self._done.get(tenant, 0) + 1
                    self._changed.notify_all()

    def wait(self, tenant: str, requests: int) -> None:
        """Until ``requests`` requests of ``tenant`` have been served to the end (a minute
        at most, for a busy machine)."""
        with self._changed:
            served = self._changed.wait_for(lambda: self._done.get(tenant, 0) >= requests, 60)
        assert served, f"{requests} requests of {tenant} were not served to the end"


@pytest.fixture(scope="module")
def served(apps: tuple[FastAPI, flask.Flask]) -> Served:
    return Served(apps[0])


@pytest.fixture(scope="module")
def servers(served: Served, apps: tuple[FastAPI, flask.Flask]) -> Iterator[dict[str, str]]:
    with serve_asgi(served) as fastapi_url, serve_wsgi(apps[1]) as flask_url:
        yield {"fastapi": fastapi_url, "flask": flask_url}


def url(servers: dict[str, str], route: str) -> str:
    framework, path = route.split("/", 1)
    return f"{servers[framework]}/{path}"


def post(
    target: str,
    key: str | None,
    item: str,
    tenant: str | None,
    *,
    note: str = "",
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
) -> httpx.Response:
    """POST an order (or ``content``, as JSON) with ``key`` and ``tenant``, if not None."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Idempotency-Key"] = key
    if tenant is not None:
        sent["X-Tenant"] = tenant
    if content is None:
        content = json.dumps({"item": item, "note": note}).encode()
    return client.post(target, content=content, headers=sent, timeout=60)


def new_item(prefix: str = "item") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def runs(db: sa.Engine, item: str) -> int:
    return count(db, "SELECT count(*) FROM http_orders WHERE item = :i", i=item)


def keys_of(db: sa.Engine, scope: str) -> int:
    return count(db, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope)


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["type"].startswith("tag:recoverypoint,2025:")
    assert body["title"] and body["detail"]
    return body


# -- phased operations, and what every route shares -------------------------------------


@pytest.mark.parametrize("route", PHASED)
def test_a_new_key_answers_and_its_replay_is_marked_with_safe_headers_only(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    first = post(url(servers, route), "key-1", item, scope)
    again = post(url(servers, route), "key-1", item, scope)

    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.json() == {"order_id": first.json()["order_id"], "item": item}
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert again.headers["x-order"] == str(first.json()["order_id"])
    assert again.headers["location"] == f"/orders/{first.json()['order_id']}"
    assert again.headers["content-type"] == "application/json"
    for response in (first, again):
        assert "set-cookie" not in response.headers
        assert "keep-alive" not in response.headers
    assert runs(db, item) == 1


@pytest.mark.parametrize("route", ALL)
@pytest.mark.parametrize(
    "key",
    [None, "", "k" * 256, "clé-non-ascii", '"unterminated', "two,keys", '"a", "b"', "?1", "12"],
    ids=[
        "missing",
        "empty",
        "too-long",
        "non-ascii",
        "bad-sf-string",
        "comma",
        "two-strings",
        "boolean",
        "integer",
    ],
)
def test_a_missing_or_invalid_key_is_a_400_and_stores_nothing(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str, key: str | None
) -> None:
    item = new_item()
    if key is not None and not key.isascii():
        # httpx refuses to send non-ASCII header text; send its UTF-8 bytes as a client could.
        response = client.post(
            url(servers, route),
            json={"item": item},
            headers=[(b"Idempotency-Key", key.encode()), (b"X-Tenant", scope.encode())],
        )
    else:
        response = post(url(servers, route), key, item, scope)

    body = assert_problem(response, 400)
    assert "Idempotency-Key" in body["detail"] or "idempotency key" in body["detail"]
    assert keys_of(db, scope) == 0
    assert runs(db, item) == 0


@pytest.mark.parametrize("route", ALL)
def test_two_key_headers_are_a_400(servers: dict[str, str], scope: str, route: str) -> None:
    response = client.post(
        url(servers, route),
        json={"item": new_item()},
        headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b"), ("X-Tenant", scope)],
    )
    assert_problem(response, 400)


@pytest.mark.parametrize("route", ALL)
def test_a_key_sent_as_an_sf_string_is_the_same_key(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    bare = post(url(servers, route), "8e03978e-40d5", item, scope)
    quoted = post(url(servers, route), '"8e03978e-40d5"', item, scope)
    with_params = post(url(servers, route), '"8e03978e-40d5";v=1;sig=:YWJj:', item, scope)
    assert bare.status_code == quoted.status_code == with_params.status_code == 201
    assert quoted.headers["idempotent-replayed"] == "true"
    assert with_params.headers["idempotent-replayed"] == "true"
    assert quoted.json() == with_params.json() == bare.json()
    assert keys_of(db, scope) == 1


@pytest.mark.parametrize("route", ALL)
def test_a_key_in_flight_is_a_409_with_retry_after_and_then_replays(
    servers: dict[str, str], gates: Gates, db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item("hold")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, url(servers, route), "key-1", item, scope)
        assert gates.wait_entered(item)
        duplicate = post(url(servers, route), "key-1", item, scope)
        gates.release(item)
        assert first.result().status_code == 201

    body = assert_problem(duplicate, 409)
    assert body["type"].endswith(":key-in-use")
    assert int(duplicate.headers["retry-after"]) >= 1
    later = post(url(servers, route), "key-1", item, scope)
    assert later.status_code == 201 and later.headers["idempotent-replayed"] == "true"
    assert runs(db, item) == 1


@pytest.mark.parametrize("route", ALL)
def test_a_key_reused_with_other_params_is_a_422(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    assert post(url(servers, route), "key-1", item, scope).status_code == 201
    other = post(url(servers, route), "key-1", item, scope, note="changed")
    body = assert_problem(other, 422)
    assert body["type"].endswith(":params-mismatch")
    assert runs(db, item) == 1


@pytest.mark.parametrize("route", ALL)
def test_params_over_the_size_limit_are_a_413_and_store_nothing(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    response = post(url(servers, route), "key-1", new_item(), scope, note="x" * 70_000)
    assert_problem(response, 413)
    assert keys_of(db, scope) == 0


@pytest.mark.parametrize("route", ALL)
def test_a_retryable_failure_is_a_503_with_retry_after_and_no_internal_detail(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item("transient")
    response = post(url(servers, route), "key-1", item, scope)

    body = assert_problem(response, 503)
    assert int(response.headers["retry-after"]) >= 1
    assert "retry with the same key" in body["detail"]
    assert "10.1.2.3" not in response.text and SECRET not in response.text
    # The key kept its recovery point and gave its lease up: a retry runs at once.
    with db.connect() as conn:
        point, locked = conn.execute(
            sa.text("SELECT recovery_point, locked_at FROM idempotency_keys WHERE scope = :s"),
            {"s": scope},
        ).one()
    assert locked is None
    assert_problem(post(url(servers, route), "key-1", item, scope), 503)
    if route in PHASED:
        assert point == "ordered"
        assert runs(db, item) == 1  # the committed phase did not run again


@pytest.mark.parametrize("route", ALL)
def test_an_unexpected_error_is_a_500_that_says_retry_with_the_same_key(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item("fail")
    response = post(url(servers, route), "key-1", item, scope)

    body = assert_problem(response, 500)
    assert RETRY_TEXT in body["detail"]
    assert SECRET not in response.text and "Traceback" not in response.text
    # Not stuck in flight: the retry runs again (and fails again) rather than getting 409.
    assert_problem(post(url(servers, route), "key-1", item, scope), 500)


@pytest.mark.parametrize("route", ALL)
def test_keys_never_collide_across_scopes(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    mine = post(url(servers, route), "shared-key", item, scope)
    theirs = post(url(servers, route), "shared-key", item, f"{scope}-other")

    assert mine.status_code == theirs.status_code == 201
    assert "idempotent-replayed" not in theirs.headers
    assert mine.json()["order_id"] != theirs.json()["order_id"]
    assert runs(db, item) == 2


@pytest.mark.parametrize("route", ALL)
def test_the_application_refuses_before_any_key_is_stored(
    servers: dict[str, str], db: sa.Engine, route: str
) -> None:
    key, item = str(uuid.uuid4()), new_item()
    response = post(url(servers, route), key, item, tenant=None)
    assert response.status_code == 401
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = :k", k=key) == 0
    assert runs(db, item) == 0


@pytest.mark.parametrize("route", ALL)
def test_concurrent_duplicates_get_one_201_and_409s_or_replays(
    servers: dict[str, str], gates: Gates, db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item("hold")
    target = url(servers, route)
    with ThreadPoolExecutor(8) as pool:
        sent = [pool.submit(post, target, "key-1", item, scope) for _ in range(8)]
        assert gates.wait_entered(item)
        # Hold the winner until every other request has been answered, so they overlap.
        deadline = time.monotonic() + 30
        while sum(f.done() for f in sent) < len(sent) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        held = [f for f in sent if not f.done()]
        gates.release(item)
        answers = [f.result() for f in sent]
    answers += [post(target, "key-1", item, scope) for _ in range(2)]

    fresh = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(fresh) == 1
    assert len(held) == 1 and held[0].result() is fresh[0]
    for answer in answers:
        if answer is fresh[0]:
            continue
        if answer.status_code == 409:
            assert "retry-after" in answer.headers
        else:
            assert answer.status_code == 201
            assert answer.headers["idempotent-replayed"] == "true"
            assert answer.json() == fresh[0].json()
    assert runs(db, item) == 1


# -- single-step endpoints ---------------------------------------------------------------


@pytest.mark.parametrize("route", SINGLE)
def test_a_single_step_endpoint_answers_itself_first_and_replays_without_cookies(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    first = post(url(servers, route), "key-1", item, scope)
    again = post(url(servers, route), "key-1", item, scope)

    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers["set-cookie"].startswith("session=secret")
    assert first.json() == {"order_id": first.json()["order_id"], "item": item}
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert again.headers["x-order"] == first.headers["x-order"]
    assert again.headers["content-type"] == "application/json"
    assert "set-cookie" not in again.headers
    assert runs(db, item) == 1
    with db.connect() as conn:  # the cookie is not kept at rest either
        stored = conn.scalar(
            sa.text(
                "SELECT state::text || response_headers::text FROM idempotency_keys "
                "WHERE scope = :s"
            ),
            {"s": scope},
        )
    assert "x-order" in stored.lower() and "secret" not in stored


@pytest.mark.parametrize("route", SINGLE)
def test_a_single_step_fingerprint_covers_the_body_and_the_query(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item()
    assert post(url(servers, route), "key-1", item, scope).status_code == 201

    other_body = post(url(servers, route), "key-1", item, scope, note="changed")
    other_query = post(url(servers, route) + "?page=2", "key-1", item, scope)

    assert assert_problem(other_body, 422)["type"].endswith(":params-mismatch")
    assert assert_problem(other_query, 422)["type"].endswith(":params-mismatch")
    assert runs(db, item) == 1


@pytest.mark.parametrize("route", SINGLE)
def test_a_failed_single_step_endpoint_runs_again_when_the_client_retries(
    servers: dict[str, str], db: sa.Engine, scope: str, route: str
) -> None:
    item = new_item("flaky")
    failed = post(url(servers, route), "key-1", item, scope)
    retried = post(url(servers, route), "key-1", item, scope)

    assert RETRY_TEXT in assert_problem(failed, 500)["detail"]
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert runs(db, item) == 1


def test_a_single_step_endpoint_refuses_to_run_without_the_middleware(
    http_engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    idempotency = rp_fastapi.Idempotency(http_engine, scope=lambda request: scope)
    app = FastAPI()

    @app.post("/unprotected")
    @idempotency.single_step("http_single_without_middleware")
    def unprotected() -> dict[str, str]:
        with db.begin() as conn:
            conn.execute(sa.text("INSERT INTO http_orders (item) VALUES (:s)"), {"s": scope})
        return {}

    with serve_asgi(app) as base_url:
        response = client.post(f"{base_url}/unprotected", headers={"Idempotency-Key": "k"})
    assert response.status_code == 500
    assert runs(db, scope) == 0


def key_row(db: sa.Engine, scope: str) -> dict[str, Any]:
    with db.connect() as conn:
        return dict(
            conn.execute(
                sa.text(
                    "SELECT recovery_point, response_status, attempts, last_error "
                    "FROM idempotency_keys WHERE scope = :s"
                ),
                {"s": scope},
            )
            .mappings()
            .one()
        )


# -- single-step: the answer is the endpoint's own, kept byte for byte --------------------


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
@pytest.mark.parametrize("kind", list(EXACT_BODIES))
def test_a_single_step_replay_carries_the_first_answers_bytes(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str, kind: str
) -> None:
    item = new_item()
    target = f"{servers[framework]}/sync/body/{kind}"
    first = post(target, "key-1", item, scope)
    again = post(target, "key-1", item, scope)

    assert first.status_code == again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert first.headers["content-digest"] == content_digest(first.content)
    assert again.headers["content-digest"] == first.headers["content-digest"]
    assert again.headers["content-type"] == first.headers["content-type"]
    if kind in ("nul-byte", "binary", "unsorted"):
        assert first.content.endswith(EXACT_BODIES[kind][0][1:])
    assert runs(db, item) == 1
    assert key_row(db, scope)["response_status"] == 200


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
@pytest.mark.parametrize("status", [409, 410])
def test_a_single_step_endpoints_http_error_is_its_stored_answer(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str, status: int
) -> None:
    item = new_item()
    target = f"{servers[framework]}/sync/refuse/{status}"
    first = post(target, "key-1", item, scope)
    again = post(target, "key-1", item, scope)

    assert first.status_code == again.status_code == status
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert f"refused with {status}" in first.text
    if framework == "flask" and status == 409:  # the application's error handler answered
        assert first.json()["title"] == "conflict"
    assert runs(db, item) == 1
    assert key_row(db, scope)["response_status"] == status


# -- single-step: answers given before the endpoint ran leave no key ----------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_auth_dependencys_401_leaves_no_key_and_the_authorised_retry_runs_once(
    servers: dict[str, str], db: sa.Engine, scope: str, mode: str
) -> None:
    item = new_item()
    target = f"{servers['fastapi']}/{mode}/authed"
    refused = post(target, "key-1", item, scope, headers={"Authorization": "Bearer expired"})

    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert keys_of(db, scope) == 0

    good = {"Authorization": "Bearer good"}
    fixed = post(target, "key-1", item, scope, headers=good)
    again = post(target, "key-1", item, scope, headers=good)
    assert fixed.status_code == again.status_code == 201
    assert "idempotent-replayed" not in fixed.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == fixed.content
    assert runs(db, item) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_body_that_fails_validation_leaves_no_key_and_the_fixed_body_runs_once(
    servers: dict[str, str], db: sa.Engine, scope: str, mode: str
) -> None:
    item = new_item()
    target = f"{servers['fastapi']}/{mode}/authed"
    good = {"Authorization": "Bearer good"}
    invalid = post(target, "key-1", item, scope, headers=good, content=b'{"itm": "typo"}')

    assert invalid.status_code == 422
    assert invalid.json()["detail"][0]["loc"] == ["body", "item"]  # FastAPI's own answer
    assert keys_of(db, scope) == 0

    fixed = post(target, "key-1", item, scope, headers=good)
    assert fixed.status_code == 201 and "idempotent-replayed" not in fixed.headers
    assert runs(db, item) == 1


# -- single-step: background tasks follow the committed answer ----------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_background_tasks_run_after_the_answer_is_committed(
    servers: dict[str, str], served: Served, gates: Gates, db: sa.Engine, scope: str, mode: str
) -> None:
    item = new_item()
    target = f"{servers['fastapi']}/{mode}/background"
    first = post(target, "key-1", item, scope)

    assert first.status_code == 201
    served.wait(scope, 1)
    assert gates.notes(item) == [201]  # the key was finished when the task ran
    again = post(target, "key-1", item, scope)
    assert again.headers["idempotent-replayed"] == "true"
    served.wait(scope, 2)
    assert gates.notes(item) == [201]  # a replay runs no background task
    assert runs(db, item) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_background_task_changes_neither_the_answer_nor_the_key(
    servers: dict[str, str],
    served: Served,
    gates: Gates,
    db: sa.Engine,
    scope: str,
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    item = new_item("bgfail")
    target = f"{servers['fastapi']}/{mode}/background"
    with caplog.at_level(logging.ERROR, logger="recoverypoint.http"):
        first = post(target, "key-1", item, scope)
        served.wait(scope, 1)
        assert gates.notes(item) == [201]
    again = post(target, "key-1", item, scope)

    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert runs(db, item) == 1
    row = key_row(db, scope)
    # One attempt, counted by its claim: the failing task after the answer is not one.
    assert (row["response_status"], row["attempts"], row["last_error"]) == (201, 1, None)
    assert any("after its committed answer failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("query", ["", "?stream=true"], ids=["json", "streaming"])
def test_background_tasks_never_run_for_an_answer_that_was_not_committed(
    servers: dict[str, str], served: Served, gates: Gates, db: sa.Engine, scope: str, query: str
) -> None:
    item = new_item("lease")
    target = f"{servers['fastapi']}/sync/lease{query}"
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, target, "key-1", item, scope)
        assert gates.wait_entered(item)
        # An operator releases its lease by force while the endpoint is held (a live
        # request keeps its lease however long it runs).
        with db.connect() as conn:
            key_id = conn.execute(
                sa.text("SELECT id FROM idempotency_keys WHERE scope = :s"), {"s": scope}
            ).scalar_one()
        assert admin.release(admin.Admin(db), key_id, force=True).changed == (key_id,)
        second = post(target, "key-1", item, scope)  # takes the key over and finishes it
        gates.release(item)
        lost = first.result()

    assert second.status_code == 201 and "idempotent-replayed" not in second.headers
    assert assert_problem(lost, 409)["type"].endswith(":lock-lost")
    served.wait(scope, 2)
    assert gates.notes(item) == [201]  # the second request's task only
    assert runs(db, item) == 2  # a lease released by force: the endpoint ran twice


# -- bad bodies are a 4xx and store nothing ------------------------------------------------


DEEP = 30_000  # deeper than Python's recursion limit, smaller than the params limit


# FastAPI's phased routes parse their bodies themselves (a 400 or 422 of FastAPI's own);
# Flask's read it through `idempotency.run(op)`.
@pytest.mark.parametrize("route", [*SINGLE, "flask/sync/orders"])
@pytest.mark.parametrize(
    ("content", "status", "says"),
    [
        (b'{"item": "\\ud800"}', 422, "surrogate"),
        (b'{"item": "x", "deep": ' + b"[" * 100 + b"]" * 100 + b"}", 422, "64"),
        (b'{"item": "x", "deep": ' + b"[" * DEEP + b"]" * DEEP + b"}", 422, "64"),
        (b"[" * 40_000 + b"]" * 40_000, 413, "limit"),
        (b'{"item": "x"}' + b" " * 70_000, 413, "limit"),
    ],
    ids=["lone-surrogate", "deep", "deeper-than-recursion", "deep-and-large", "large"],
)
def test_bad_single_step_bodies_are_a_4xx_and_store_nothing(
    servers: dict[str, str],
    db: sa.Engine,
    scope: str,
    route: str,
    content: bytes,
    status: int,
    says: str,
) -> None:
    response = post(url(servers, route), "key-1", "x", scope, content=content)

    assert says in assert_problem(response, status)["detail"]
    assert keys_of(db, scope) == 0
    assert runs(db, "x") == 0


# A hostile client streams a body without end: it is refused once past the params limit,
# never held whole. Driven below HTTP, where what the server read can be counted (over a
# socket the client would see its upload cut off rather than the 413).
ENDLESS = 10_000  # chunks of 8 KiB: 80 MiB, far past the 64 KiB limit


class EndlessBody:
    """A request body of ``ENDLESS`` chunks of spaces that counts what was read of it."""

    def __init__(self) -> None:
        self.read = 0

    def chunk(self, size: int = 8192) -> bytes:
        size = min(size, ENDLESS * 8192 - self.read)
        self.read += size
        return b" " * size

    def more(self) -> bool:
        return self.read < ENDLESS * 8192


@pytest.mark.parametrize("path", ["/sync/single", "/async/single"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("keyed", [True, False], ids=["key", "no-key"])
def test_fastapi_a_body_past_the_limit_is_refused_before_it_is_read_whole(
    apps: tuple[FastAPI, flask.Flask],
    http_engine: rp.Engine,
    db: sa.Engine,
    scope: str,
    path: str,
    declared: bool,
    keyed: bool,
) -> None:
    body, sent = EndlessBody(), []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body.chunk(), "more_body": body.more()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = {"x-tenant": scope, "content-type": "application/json"}
    if keyed:
        headers["idempotency-key"] = "key-1"
    if declared:
        headers["content-length"] = str(ENDLESS * 8192)
    request = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "server": ("testserver", 80),
        "client": ("testclient", 50000),
    }
    anyio.run(apps[0], request, receive, send)

    problem = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    if not keyed:  # refused by its headers alone, as Flask refuses it
        assert sent[0]["status"] == 400 and "Idempotency-Key" in problem["detail"]
        assert body.read == 0
    else:
        assert sent[0]["status"] == 413
        assert "limit" in problem["detail"]
        # A declared length is refused unread; a stream, one chunk past the limit at most.
        assert body.read <= (0 if declared else http_engine.max_params_bytes + 8192)
    assert keys_of(db, scope) == 0


UNDECLARED = Request({"type": "http", "method": "POST", "path": "/", "headers": []})


@settings(max_examples=200)
@given(
    chunks=st.lists(st.binary(max_size=40), max_size=12),
    limit=st.integers(min_value=0, max_value=200),
)
def test_fastapi_body_reading_stops_at_the_limit_for_any_chunking(
    chunks: list[bytes], limit: int
) -> None:
    """Whatever the chunking: the body whole if it fits the limit; else refused, having
    read no more than the limit and the chunk that crossed it."""
    handed: list[int] = []

    async def receive() -> dict[str, Any]:
        handed.append(len(handed))
        last = len(handed) >= len(chunks)
        return {
            "type": "http.request",
            "body": chunks[len(handed) - 1] if chunks else b"",
            "more_body": not last,
        }

    whole = b"".join(chunks)
    if len(whole) <= limit:
        assert anyio.run(rp_fastapi._read_body, UNDECLARED, receive, limit) == whole
    else:
        with pytest.raises(rp.RequestTooLarge, match="limit"):
            anyio.run(rp_fastapi._read_body, UNDECLARED, receive, limit)
        read = sum(len(c) for c in chunks[: len(handed)])
        assert read - len(chunks[len(handed) - 1]) <= limit < read


class CountingStream:
    """A WSGI input stream over an :class:`EndlessBody`."""

    def __init__(self) -> None:
        self.body = EndlessBody()

    def read(self, size: int = -1) -> bytes:
        return self.body.chunk(ENDLESS * 8192 if size < 0 else size)


@pytest.mark.parametrize("path", ["/sync/orders", "/sync/single"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_flask_a_body_past_the_limit_is_refused_before_it_is_read_whole(
    apps: tuple[FastAPI, flask.Flask],
    http_engine: rp.Engine,
    db: sa.Engine,
    scope: str,
    path: str,
    declared: bool,
) -> None:
    stream = CountingStream()
    headers = {"Idempotency-Key": "key-1", "X-Tenant": scope, "Content-Type": "application/json"}
    environ = EnvironBuilder(path, method="POST", headers=headers).get_environ()
    environ["wsgi.input"] = stream
    # A server that ends a chunked body itself says so (werkzeug's own does).
    environ["wsgi.input_terminated"] = True
    if declared:
        environ["CONTENT_LENGTH"] = str(ENDLESS * 8192)
    else:
        environ.pop("CONTENT_LENGTH", None)
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"

    chunks, status, answered = run_wsgi_app(apps[1], environ)

    assert status.startswith("413") and answered["Content-Type"] == PROBLEM
    assert "limit" in json.loads(b"".join(chunks))["detail"]
    # A declared length is refused unread; a stream, one read past the limit at most.
    assert stream.body.read <= (0 if declared else http_engine.max_params_bytes + 8192)
    assert keys_of(db, scope) == 0


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
@pytest.mark.parametrize("kind", ["orders", "single"])
def test_a_nul_in_the_path_is_a_422_before_the_claim(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str, kind: str
) -> None:
    item = new_item()
    response = post(f"{servers[framework]}/sync/accounts/%00/{kind}", "key-1", item, scope)

    assert "path" in assert_problem(response, 422)["detail"]
    assert keys_of(db, scope) == 0
    assert runs(db, item) == 0


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
@pytest.mark.parametrize("kind", ["orders", "single"])
@pytest.mark.parametrize(
    ("first", "other"),
    [("a%3Fb", "a%253Fb"), ("a%253Fb", "a%3Fb")],
    ids=["escaped-then-twice", "twice-then-escaped"],
)
def test_a_path_escaped_once_and_twice_are_two_targets(
    servers: dict[str, str],
    db: sa.Engine,
    scope: str,
    framework: str,
    kind: str,
    first: str,
    other: str,
) -> None:
    """``a%3Fb`` (the account ``a?b``) and ``a%253Fb`` (the account ``a%3Fb``) are two paths;
    the same key sent to both is a 422, never the replay of the other's answer."""
    item = new_item()
    answered = post(f"{servers[framework]}/sync/accounts/{first}/{kind}", "key-1", item, scope)
    again = post(f"{servers[framework]}/sync/accounts/{other}/{kind}", "key-1", item, scope)

    assert answered.status_code == 201, answered.text
    assert "Idempotent-Replayed" not in again.headers
    assert assert_problem(again, 422)["type"].endswith(":params-mismatch")
    assert runs(db, item) == 1


def test_a_single_step_endpoint_shows_fastapi_its_models_not_their_names() -> None:
    """This module's annotations are strings (``from __future__ import annotations``); the
    single-step wrapper hands FastAPI the endpoint's models, evaluated where they were
    written, as FastAPI's older releases look for them in the wrapper's module."""
    import inspect

    from recoverypoint.integrations import fastapi as rp_fastapi

    def endpoint(order: Order, tries: int = 1) -> dict[str, Any]:
        return {}

    async def async_endpoint(order: Order) -> None: ...

    for wrapped in (rp_fastapi._guarded(endpoint), rp_fastapi._guarded(async_endpoint)):
        assert inspect.signature(wrapped).parameters["order"].annotation is Order
    assert inspect.signature(rp_fastapi._guarded(endpoint)).return_annotation == dict[str, Any]
