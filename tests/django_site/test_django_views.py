"""Single-step Django views of every kind, through the real Django stack and PostgreSQL."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.authtoken.models import Token

from . import views

pytestmark = pytest.mark.django_db(transaction=True)

KINDS = {
    "function": "/function",
    "async": "/async",
    "class": "/class",
    "drf": "/drf",
    "viewset": "/viewset",
    "method_decorator": "/method-decorator",
    "action": "/viewset/refund",
}


@pytest.fixture
def user() -> User:
    return User.objects.create_user(f"rider-{uuid.uuid4()}")


@pytest.fixture
def client(user: User) -> Client:
    """Logged in as ``user`` twice over: a session for Django's views, a token for DRF's."""
    token = Token.objects.create(user=user)
    client = Client(HTTP_AUTHORIZATION=f"Token {token.key}")
    client.force_login(user)
    return client


def keys_stored() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM idempotency_keys")
        return int(cursor.fetchone()[0])


def post(client: Client, url: str, body: bytes = b'{"a": 1}', **headers: str) -> Any:
    return client.post(url, body, content_type="application/json", headers=headers)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_view_runs_once_per_key_and_replays_its_exact_bytes(client: Client, kind: str) -> None:
    key = str(uuid.uuid4())
    before = views.RUNS[kind]
    first = post(client, KINDS[kind], **{"Idempotency-Key": key})
    again = post(client, KINDS[kind], **{"Idempotency-Key": key})
    assert first.status_code == again.status_code == 201, first.content
    assert again.content == first.content  # the very bytes, NUL and 0xFF included
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert views.RUNS[kind] == before + 1
    other = post(client, KINDS[kind], **{"Idempotency-Key": str(uuid.uuid4())})
    assert other.status_code == 201 and other.content != first.content
    assert views.RUNS[kind] == before + 2


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_refusals_are_problems_and_run_nothing(client: Client, kind: str) -> None:
    before, stored = views.RUNS[kind], keys_stored()
    missing = post(client, KINDS[kind])
    assert missing.status_code == 400
    assert missing["Content-Type"] == "application/problem+json"
    twice = post(client, KINDS[kind], **{"Idempotency-Key": "k1, k1"})  # as a server joins them
    assert twice.status_code == 400
    assert views.RUNS[kind] == before and keys_stored() == stored

    key = str(uuid.uuid4())
    assert post(client, KINDS[kind], b'{"a": 1}', **{"Idempotency-Key": key}).status_code == 201
    reused = post(client, KINDS[kind], b'{"a": 2}', **{"Idempotency-Key": key})
    assert reused.status_code == 422
    assert json.loads(reused.content)["type"].endswith("params-mismatch")
    assert views.RUNS[kind] == before + 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_anonymous_request_is_refused_before_any_key(kind: str) -> None:
    before, stored = views.RUNS[kind], keys_stored()
    answer = post(Client(), KINDS[kind], **{"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code in (401, 403)  # DRF's authentication, or the scope's refusal
    assert views.RUNS[kind] == before and keys_stored() == stored


def test_keys_belong_to_their_user(client: Client) -> None:
    key = str(uuid.uuid4())
    mine = post(client, "/function", **{"Idempotency-Key": key})
    someone = Client()
    someone.force_login(User.objects.create_user(f"other-{uuid.uuid4()}"))
    theirs = post(someone, "/function", **{"Idempotency-Key": key})
    assert theirs.status_code == 201 and "Idempotent-Replayed" not in theirs
    assert theirs.content != mine.content


def test_a_view_that_raises_django_s_404_stores_the_404(client: Client) -> None:
    key = str(uuid.uuid4())
    before = views.RUNS["not_found"]
    assert post(client, "/not-found", **{"Idempotency-Key": key}).status_code == 404
    again = post(client, "/not-found", **{"Idempotency-Key": key})
    assert again.status_code == 404 and again["Idempotent-Replayed"] == "true"
    assert views.RUNS["not_found"] == before + 1


def test_a_body_over_the_limit_is_413_and_unread(client: Client) -> None:
    from examples.django_rides.rides.operations import engine

    stored = keys_stored()
    huge = b'"' + b"x" * engine.max_params_bytes + b'"'
    answer = post(client, "/function", huge, **{"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 413
    assert keys_stored() == stored


def test_a_view_left_in_atomic_requests_is_refused_as_misconfigured(client: Client) -> None:
    before, stored = views.RUNS["drf"], keys_stored()
    answer = post(client, "/drf-in-atomic", **{"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 500
    assert json.loads(answer.content)["type"].endswith("configuration-error")
    assert views.RUNS["drf"] == before and keys_stored() == stored


def test_through_a_real_server_a_key_sent_twice_is_refused(live_server: Any, user: User) -> None:
    """On the wire: two Idempotency-Key lines reach Django joined by its WSGI server."""
    import http.client
    from urllib.parse import urlsplit

    token = Token.objects.create(user=user).key
    address = urlsplit(live_server.url)

    def send(*keys: str) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            connection.putrequest("POST", "/drf")
            connection.putheader("Authorization", f"Token {token}")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", "8")
            for key in keys:
                connection.putheader("Idempotency-Key", key)
            connection.endheaders(b'{"a": 1}')
            answer = connection.getresponse()
            return answer.status, dict(answer.getheaders()), answer.read()
        finally:
            connection.close()

    before, key = views.RUNS["drf"], str(uuid.uuid4())
    status, headers, _ = send(key, key)
    assert status == 400 and headers["Content-Type"] == "application/problem+json"
    first, again = send(key), send(key)
    assert first[0] == again[0] == 201 and again[2] == first[2]
    assert again[1]["Idempotent-Replayed"] == "true"
    assert views.RUNS["drf"] == before + 1


def test_the_first_answer_sets_its_cookies_and_replays_do_not(client: Client) -> None:
    key = str(uuid.uuid4())
    first = post(client, "/cookie", **{"Idempotency-Key": key})
    again = post(client, "/cookie", **{"Idempotency-Key": key})
    assert first.cookies["cart"].value == "emptied"
    assert "cart" not in again.cookies and again["Idempotent-Replayed"] == "true"
    assert first["X-Order-Cost"] == again["X-Order-Cost"] == "3"
    assert again.content == first.content
