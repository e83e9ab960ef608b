"""Hostile input at the Django views: odd unicode, NUL and control characters in the key,
a key sent twice, any bytes as the body, JSON nested deep, a body past the limit. Each is
answered (never a 500): the view's own answer once per key, or a 4xx ``problem+json``
that ran nothing and stored no key."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token

from examples.django_rides.rides.models import Ride
from examples.django_rides.rides.operations import engine

from . import views

pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE = settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
URLS = {"function": "/function", "async": "/async", "class": "/class", "drf": "/drf"}

odd_text = st.text(
    st.characters(codec="utf-8", categories=["L", "M", "N", "P", "S", "Z", "C"]), max_size=40
)
keys = st.one_of(
    odd_text,
    st.text(st.sampled_from("\x00\r\n\t ,;\"'\\\u2028\ufeff\U0001f600é"), max_size=8),
    odd_text.map(lambda k: f"{k}, {k}"),  # one header sent twice, as the server joins it
    st.uuids().map(str),
)
bodies = st.one_of(
    st.binary(max_size=300),
    odd_text.map(lambda t: json.dumps({"note": t}).encode()),
    st.integers(1, 3000).map(lambda n: ("[" * n + "]" * n).encode()),
    st.just(b'{"a": 1, "a": 2}'),
)


@pytest.fixture
def client() -> Client:
    user = User.objects.create_user(f"hostile-{uuid.uuid4()}")
    client = Client(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    client.force_login(user)
    return client


def keys_stored() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM idempotency_keys")
        return int(cursor.fetchone()[0])


def send(client: Client, url: str, key: str, body: bytes) -> Any:
    return client.post(url, body, content_type="application/octet-stream", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.parametrize("kind", sorted(URLS))
@HOSTILE
@given(key=keys, body=bodies)
@pytest.mark.slow
def test_hostile_requests_are_answered_once_or_refused_without_a_trace(
    client: Client, kind: str, key: str, body: bytes
) -> None:
    runs, stored = views.RUNS[kind], keys_stored()
    first = send(client, URLS[kind], key, body)
    event(f"answered {first.status_code}")
    assert first.status_code in (201, 400, 413, 415, 422), first.content
    if first.status_code != 201:
        if kind != "drf" or first["Content-Type"] == "application/problem+json":
            assert first["Content-Type"] == "application/problem+json"
            assert views.RUNS[kind] == runs and keys_stored() == stored
        return
    again = send(client, URLS[kind], key, body)
    assert again.status_code == 201 and again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert views.RUNS[kind] == runs + 1


@HOSTILE
@given(origin=odd_text, key=keys)
@pytest.mark.slow
def test_hostile_rides_book_at_most_once(client: Client, origin: str, key: str) -> None:
    rides = Ride.objects.count()
    body = json.dumps({"origin": origin, "target": "b"})
    answers = [
        client.post("/rides", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
        for _ in range(2)
    ]
    statuses = {answer.status_code for answer in answers}
    assert statuses <= {201, 400, 422}, [a.content for a in answers]
    assert Ride.objects.count() - rides == (1 if 201 in statuses else 0)


def test_a_body_past_the_limit_is_refused_before_it_is_read(client: Client) -> None:
    stored = keys_stored()
    huge = b"x" * (engine.max_params_bytes + 1)
    for url in URLS.values():
        answer = send(client, url, str(uuid.uuid4()), huge)
        assert answer.status_code == 413, url
    assert keys_stored() == stored
