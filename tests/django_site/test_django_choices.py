"""The Django integration's choices, with the semantics FastAPI's and Flask's have
(tests/test_http_choices.py): the key's and the replay marker's header names, read from
Django's META as a real WSGI server writes it; the status classes stored; an optional key;
a duplicate that waits for the first request's answer; the scope (a function that names
an owner, or ``UNSCOPED`` on purpose; never ``""``)."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.django_rides.rides.operations import engine
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations.django import Idempotency

from . import choices_views as views
from .choices_views import KEY_HEADER, REPLAYED_HEADER

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def user() -> User:
    return User.objects.create_user(f"chooser-{uuid.uuid4()}")


@pytest.fixture
def client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(client: Client, url: str, body: bytes = b'{"a": 1}', **headers: str) -> Any:
    return client.post(url, body, content_type="application/json", headers=headers)


def count(sql: str, *params: Any) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.fetchone()[0])


def keys_of(operation: str) -> int:
    return count("SELECT count(*) FROM idempotency_keys WHERE operation = %s", operation)


# -- header names --------------------------------------------------------------------------


@pytest.mark.slow
def test_the_key_is_read_from_the_chosen_header_and_the_draft_s_name_is_not(
    client: Client,
) -> None:
    runs, key = views.RUNS["renamed"], str(uuid.uuid4())
    first = post(client, "/choices/renamed", **{KEY_HEADER: key})
    again = post(client, "/choices/renamed", **{KEY_HEADER: key})
    # The draft's name is not read: to this view it is any other header.
    default_name = post(client, "/choices/renamed", **{"Idempotency-Key": str(uuid.uuid4())})

    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert default_name.status_code == 400
    assert default_name["Content-Type"] == "application/problem+json"
    assert KEY_HEADER in json.loads(default_name.content)["detail"]
    assert views.RUNS["renamed"] == runs + 1
    stored = "SELECT count(*) FROM idempotency_keys WHERE operation = %s AND idempotency_key = %s"
    assert count(stored, "django_choice_renamed", key) == 1
    assert keys_of("django_choice_renamed") == 1  # the draft's name left no key


@pytest.mark.slow
def test_a_replay_is_marked_with_the_chosen_header_only(client: Client) -> None:
    key = str(uuid.uuid4())
    first = post(client, "/choices/renamed", **{KEY_HEADER: key})
    again = post(client, "/choices/renamed", **{KEY_HEADER: key})

    assert REPLAYED_HEADER not in first and "Idempotent-Replayed" not in first
    assert again[REPLAYED_HEADER] == "true"
    assert "Idempotent-Replayed" not in again


def test_a_key_header_django_cannot_tell_apart_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="'-'"):
        Idempotency(engine, key_header="X_Request_Id")
    with pytest.raises(ValueError, match="key_header"):
        Idempotency(engine, key_header="Content-Type")
    with pytest.raises(ValueError, match="both"):
        Idempotency(engine, key_header="X-Key", replayed_header="x-key")


# -- stored status classes -------------------------------------------------------------------


@pytest.mark.slow
def test_an_answer_of_a_class_not_stored_leaves_no_key_and_the_retry_runs_again(
    client: Client,
) -> None:
    runs, key = views.RUNS["failing"], str(uuid.uuid4())
    first = post(client, "/choices/failing", **{"Idempotency-Key": key})
    assert keys_of("django_choice_no_5xx") == 0
    again = post(client, "/choices/failing", **{"Idempotency-Key": key})

    assert first.status_code == again.status_code == 500
    assert json.loads(first.content)["run"] == runs + 1
    assert json.loads(again.content)["run"] == runs + 2
    assert "Idempotent-Replayed" not in again
    assert views.RUNS["failing"] == runs + 2
    assert keys_of("django_choice_no_5xx") == 0


@pytest.mark.slow
def test_an_answer_of_a_stored_class_is_still_replayed(client: Client) -> None:
    runs, key = views.RUNS["not_found"], str(uuid.uuid4())
    first = post(client, "/choices/not-found", **{"Idempotency-Key": key})
    again = post(client, "/choices/not-found", **{"Idempotency-Key": key})
    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"
    assert views.RUNS["not_found"] == runs + 1


def test_stored_classes_and_wait_are_checked_when_made() -> None:
    for classes in ((), (1,), "5", (5.0,)):
        with pytest.raises(ValueError, match="stored_classes"):
            Idempotency(engine, stored_classes=classes)  # type: ignore[arg-type]
    for wait in (-1, float("nan"), 61, "30"):
        with pytest.raises(ValueError, match="wait"):
            Idempotency(engine, wait=wait)  # type: ignore[arg-type]


# -- optional keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("/choices/optional", "optional"),
        ("/choices/optional-async", "optional_async"),
        ("/choices/optional-phased", "optional_phased"),
        ("/choices/optional-phased-async", "optional_phased"),
    ],
)
@pytest.mark.slow
def test_an_optional_key_not_sent_runs_unprotected_and_says_so(
    client: Client, url: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    runs = views.RUNS[kind]
    with caplog.at_level(logging.INFO, logger="recoverypoint.http"):
        answers = [post(client, url) for _ in range(2)]

    for answer in answers:
        assert answer.status_code == 201, answer.content
        assert answer["Idempotent-Unprotected"] == "true"
        assert "Idempotent-Replayed" not in answer
    assert views.RUNS[kind] == runs + 2  # no protection from the duplicate: both ran
    unprotected = [r for r in caplog.records if getattr(r, "idempotency", None) == "unprotected"]
    assert len(unprotected) == 2
    # A single-step view's unprotected answer is not stored; a phased operation's runs
    # under a key of its own, which no retry can name.
    assert keys_of("django_choice_optional") == keys_of("django_choice_optional_async") == 0
    assert (
        count(
            "SELECT count(*) FROM idempotency_keys WHERE operation = 'django_choice_noted' "
            "AND idempotency_key NOT LIKE 'unprotected-%%'"
        )
        == 0
    )


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("/choices/optional", "optional"),
        ("/choices/optional-async", "optional_async"),
        ("/choices/optional-phased", "optional_phased"),
        ("/choices/optional-phased-async", "optional_phased"),
    ],
)
@pytest.mark.slow
def test_an_optional_key_sent_protects_as_a_required_one_and_an_empty_one_is_refused(
    client: Client, url: str, kind: str
) -> None:
    runs, key = views.RUNS[kind], str(uuid.uuid4())
    first = post(client, url, **{"Idempotency-Key": key})
    again = post(client, url, **{"Idempotency-Key": key})
    empty = post(client, url, **{"Idempotency-Key": ""})

    assert first.status_code == again.status_code == 201
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Unprotected" not in first and "Idempotent-Unprotected" not in again
    assert empty.status_code == 400
    assert views.RUNS[kind] == runs + 1


def test_a_required_key_stays_the_default(client: Client) -> None:
    runs = views.RUNS["renamed"]
    assert post(client, "/choices/renamed").status_code == 400
    assert views.RUNS["renamed"] == runs


# -- waiting for the first request's answer --------------------------------------------------


@pytest.mark.slow
def test_a_duplicate_waits_for_the_first_request_s_answer_instead_of_a_409(
    live_server: Any, client: Client
) -> None:
    """Through a real threaded server: the duplicate LISTENs on a connection of its own to
    Django's database, and is woken by the first request's commit."""
    address = urlsplit(live_server.url)
    cookie = f"sessionid={client.cookies['sessionid'].value}"
    key, runs = str(uuid.uuid4()), views.RUNS["waited"]

    def send() -> tuple[int, dict[str, str], bytes]:
        wire = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            wire.request(
                "POST",
                "/choices/waited",
                b'{"a": 1}',
                {"Cookie": cookie, "Content-Type": "application/json", "Idempotency-Key": key},
            )
            answer = wire.getresponse()
            return answer.status, dict(answer.getheaders()), answer.read()
        finally:
            wire.close()

    views.ENTERED.clear()
    views.RELEASE.clear()
    with ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(send)
            assert views.ENTERED.wait(60)
            duplicate = pool.submit(send)
            # The duplicate waits LISTENing on a connection of its own, holding the key's
            # lock shared; until then it is not known to wait.
            woken = threading.Event()
            for _ in range(600):
                if listening() or duplicate.done():
                    break
                woken.wait(0.05)
            assert listening() == 1, duplicate.result() if duplicate.done() else "not waiting"
        finally:
            views.RELEASE.set()  # the first request answers, whatever happened
        answered, replayed = first.result(60), duplicate.result(60)

    assert answered[0] == replayed[0] == 201
    assert replayed[1]["Idempotent-Replayed"] == "true"
    assert replayed[2] == answered[2]
    assert views.RUNS["waited"] == runs + 1


def listening() -> int:
    return count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE '%%pg_advisory_lock_shared%%' AND state = 'idle'"
    )


# -- scopes ----------------------------------------------------------------------------------


def test_unscoped_keys_share_one_scope_on_purpose(client: Client) -> None:
    runs, key = views.RUNS["unscoped"], str(uuid.uuid4())
    anonymous = post(Client(), "/choices/unscoped", **{"Idempotency-Key": key})
    logged_in = post(client, "/choices/unscoped", **{"Idempotency-Key": key})
    assert anonymous.status_code == 201
    assert logged_in["Idempotent-Replayed"] == "true"
    assert logged_in.content == anonymous.content
    assert views.RUNS["unscoped"] == runs + 1
    shared = "SELECT count(*) FROM idempotency_keys WHERE operation = %s AND scope = ''"
    assert count(shared, "django_choice_unscoped") == 1


@pytest.mark.slow
def test_a_scope_function_that_returns_an_empty_scope_is_refused_and_stores_nothing(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    runs = views.RUNS["empty"]
    with caplog.at_level(logging.ERROR, logger="recoverypoint.http"):
        answer = post(client, "/choices/empty", **{"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 500
    assert answer["Content-Type"] == "application/problem+json"
    assert json.loads(answer.content)["type"].endswith(":configuration-error")
    assert views.RUNS["empty"] == runs
    assert keys_of("django_choice_empty") == 0
    assert any("empty scope" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_scope_that_is_neither_a_function_nor_unscoped_is_refused() -> None:
    for scope in ("", None, "tenant", 0):
        with pytest.raises(ValueError, match="UNSCOPED"):
            Idempotency(engine, scope=scope)  # type: ignore[arg-type]
    assert Idempotency(engine, scope=UNSCOPED).scope is UNSCOPED


# -- any header name, through a real WSGI server ---------------------------------------------

_TOKEN = st.from_regex(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", fullmatch=True)
_NAMES = st.one_of(
    _TOKEN,
    _TOKEN.map(lambda name: name.replace("_", "-")),
    st.text(max_size=70),
    st.sampled_from(
        ["", " ", "Idempotency Key", "X-Key\r\nX-Evil: 1", "X\x00", "Content-Length", "Host"]
    ),
    st.sampled_from(["idempotency-key", "X-REQUEST-ID", "x-a-b-c", "Authorization", "-", "a"]),
)


def wire_post(live_server: Any) -> Callable[..., tuple[int, dict[str, str], bytes]]:
    address = urlsplit(live_server.url)

    def send(url: str, *headers: tuple[str, str]) -> tuple[int, dict[str, str], bytes]:
        wire = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            wire.putrequest("POST", url)
            wire.putheader("Content-Type", "application/json")
            wire.putheader("Content-Length", "8")
            for name, value in headers:
                wire.putheader(name, value)
            wire.endheaders(b'{"a": 1}')
            answer = wire.getresponse()
            return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
        finally:
            wire.close()

    return send


@settings(
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(name=_NAMES)
@pytest.mark.slow
def test_any_key_header_name_is_read_as_sent_or_refused_when_made(
    live_server: Any, name: str
) -> None:
    try:
        view_id = views.named(name)
    except ValueError as exc:
        assert "key_header" in str(exc)
        return
    send, url, key = wire_post(live_server), f"/choices/named/{view_id}", str(uuid.uuid4())
    # The client may spell the name in any case; the server turns it into Django's META name.
    first = send(url, (name.swapcase(), key))
    again = send(url, (name.lower(), key))
    twice = send(url, (name, key), (name.upper(), key))

    assert first[0] == again[0] == 200, first[2]
    assert again[2] == first[2] and again[1]["idempotent-replayed"] == "true"
    assert twice[0] == 400 and twice[1]["content-type"] == "application/problem+json"
    if name.lower() != "idempotency-key":
        assert send(url, ("Idempotency-Key", key))[0] == 400
    assert views.RUNS[view_id] == 1
    stored = "SELECT idempotency_key FROM idempotency_keys WHERE operation = %s"
    with connection.cursor() as cursor:
        cursor.execute(stored, [f"django_choice_named_{view_id}"])
        assert cursor.fetchall() == [(key,)]
