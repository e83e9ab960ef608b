"""What an integration's user chooses, over real HTTP (uvicorn for FastAPI, werkzeug for
Flask) on the session's PostgreSQL: the key's and the replay marker's header names, the
status classes stored, an optional key, and the scope (a function that names an owner, or
``UNSCOPED`` on purpose; never ``""``)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from choices_apps import HOLDS, KEY_HEADER, REPLAYED_HEADER, SCHEMA, fastapi_app, flask_app
from docs_snippets import blocks, page
from http_servers import client, serve_asgi, serve_wsgi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rides import count
from starlette.requests import Request

import recoverypoint as rp
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations import fastapi as rp_fastapi
from recoverypoint.integrations import flask as rp_flask
from recoverypoint.integrations._base import BaseIdempotency
from recoverypoint.integrations._problem import Reply, read_key

FRAMEWORKS = ["fastapi", "flask"]


@pytest.fixture(scope="module")
def servers(db: sa.Engine) -> Iterator[dict[str, str]]:
    with db.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    engine = rp.Engine(db)
    with serve_asgi(fastapi_app(engine)) as fastapi_url, serve_wsgi(flask_app(engine)) as flask_url:
        yield {"fastapi": fastapi_url, "flask": flask_url}


def post(
    servers: dict[str, str],
    framework: str,
    path: str,
    item: str,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    return client.post(
        servers[framework] + path, json={"item": item}, headers=headers or {}, timeout=60
    )


def new_item() -> str:
    return f"item-{uuid.uuid4().hex[:12]}"


def runs(db: sa.Engine, item: str) -> int:
    return count(db, "SELECT count(*) FROM choice_runs WHERE item = :i", i=item)


def keys_of(db: sa.Engine, operation: str, scope: str | None = None) -> int:
    sql = "SELECT count(*) FROM idempotency_keys WHERE operation = :o"
    if scope is None:
        return count(db, sql, o=operation)
    return count(db, sql + " AND scope = :s", o=operation, s=scope)


# -- header names --------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_key_and_the_replay_marker_are_read_and_written_under_their_chosen_names(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str
) -> None:
    item = new_item()
    sent = {KEY_HEADER: "k-1", "X-Tenant": scope}
    first = post(servers, framework, "/answer/201", item, sent)
    again = post(servers, framework, "/answer/201", item, sent)
    # The draft's name is not read: to this service it is any other header.
    default_name = post(servers, framework, "/answer/201", item, {"Idempotency-Key": "k-2"})

    assert first.status_code == again.status_code == 201
    assert REPLAYED_HEADER.lower() not in first.headers
    assert again.headers[REPLAYED_HEADER] == "true"
    assert "idempotent-replayed" not in again.headers
    assert again.json() == first.json() == {"item": item, "runs": 1}
    assert default_name.status_code == 400
    assert KEY_HEADER in default_name.json()["detail"]
    assert runs(db, item) == 1


# -- stored status classes -------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_answer_of_a_class_not_stored_leaves_no_key_and_the_retry_runs_again(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str
) -> None:
    item = new_item()
    sent = {KEY_HEADER: "k-1", "X-Tenant": scope}
    first = post(servers, framework, "/answer/500", item, sent)
    assert keys_of(db, f"choice_answer_{framework}", scope) == 0
    again = post(servers, framework, "/answer/500", item, sent)

    assert first.status_code == again.status_code == 500
    assert first.json()["runs"] == 1 and again.json()["runs"] == 2
    assert REPLAYED_HEADER.lower() not in again.headers
    assert runs(db, item) == 2
    assert keys_of(db, f"choice_answer_{framework}", scope) == 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_answer_of_a_stored_class_is_replayed_4xx_and_by_default_5xx(
    servers: dict[str, str], db: sa.Engine, framework: str
) -> None:
    chosen, default = new_item(), new_item()
    for _ in range(2):
        conflict = post(servers, framework, "/answer/409", chosen, {KEY_HEADER: chosen})
        failed = post(servers, framework, "/unscoped/503", default, {"Idempotency-Key": default})

    assert conflict.status_code == 409 and conflict.headers[REPLAYED_HEADER] == "true"
    assert failed.status_code == 503 and failed.headers["Idempotent-Replayed"] == "true"
    assert failed.json() == {"item": default, "runs": 1}
    assert runs(db, chosen) == runs(db, default) == 1


# -- optional keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/optional", "/optional-phased"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_optional_key_not_sent_runs_unprotected_and_says_so(
    servers: dict[str, str],
    db: sa.Engine,
    scope: str,
    framework: str,
    path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    item = new_item()
    with caplog.at_level(logging.INFO, logger="recoverypoint.http"):
        answers = [post(servers, framework, path, item, {"X-Tenant": scope}) for _ in range(2)]

    for answer in answers:
        assert answer.status_code in (200, 201), answer.text
        assert answer.headers["Idempotent-Unprotected"] == "true"
        assert REPLAYED_HEADER.lower() not in answer.headers
    assert runs(db, item) == 2  # no protection from the duplicate: both ran
    unprotected = [r for r in caplog.records if getattr(r, "idempotency", None) == "unprotected"]
    assert len(unprotected) == 2
    assert "event=unprotected" in unprotected[0].getMessage()


@pytest.mark.parametrize("path", ["/optional", "/optional-phased"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_optional_key_sent_protects_as_a_required_one_and_an_empty_one_is_refused(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str, path: str
) -> None:
    item = new_item()
    sent = {KEY_HEADER: "k-1", "X-Tenant": scope}
    first = post(servers, framework, path, item, sent)
    again = post(servers, framework, path, item, sent)
    empty = post(servers, framework, path, item, {KEY_HEADER: "", "X-Tenant": scope})

    assert again.status_code == first.status_code
    assert again.headers[REPLAYED_HEADER] == "true"
    assert "idempotent-unprotected" not in {**first.headers, **again.headers}
    assert empty.status_code == 400
    assert runs(db, item) == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_required_key_stays_the_default(
    servers: dict[str, str], db: sa.Engine, framework: str
) -> None:
    item = new_item()
    missing = post(servers, framework, "/answer/201", item)
    assert missing.status_code == 400
    assert runs(db, item) == 0


# -- waiting for the first request's answer --------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_duplicate_waits_for_the_first_requests_answer_instead_of_a_409(
    servers: dict[str, str], db: sa.Engine, scope: str, framework: str
) -> None:
    item = new_item()
    HOLDS.hold(item)
    sent = {"Idempotency-Key": "k-1", "X-Tenant": scope}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, servers, framework, "/held", item, sent)
        assert HOLDS.entered[item].wait(60)
        duplicate = pool.submit(post, servers, framework, "/held", item, sent)
        # The duplicate waits LISTENing on a connection of its own; then the first answers.
        for _ in range(600):
            if listening(db):
                break
            threading.Event().wait(0.05)
        assert listening(db) >= 1
        HOLDS.released[item].set()
        answered, replayed = first.result(60), duplicate.result(60)

    assert answered.status_code == replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.json() == answered.json() == {"item": item, "runs": 1}
    assert runs(db, item) == 1


def listening(db: sa.Engine) -> int:
    return count(
        db,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE '%%pg_advisory_lock_shared%%' AND state = 'idle'",
    )


def test_a_wait_past_the_cap_is_refused_when_the_integration_is_made(db: sa.Engine) -> None:
    engine = rp.Engine(db)
    for wait in (-1, float("nan"), 61, "30"):
        with pytest.raises(ValueError, match="wait"):
            rp_flask.Idempotency(engine, scope=UNSCOPED, wait=wait)  # type: ignore[arg-type]


# -- scopes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unscoped_keys_share_one_scope_on_purpose(
    servers: dict[str, str], db: sa.Engine, framework: str
) -> None:
    item = new_item()
    first = post(servers, framework, "/unscoped/201", item, {"Idempotency-Key": item})
    other = post(
        servers, framework, "/unscoped/201", item, {"Idempotency-Key": item, "X-Tenant": "b"}
    )
    assert other.headers["Idempotent-Replayed"] == "true"
    assert other.json() == first.json()
    assert runs(db, item) == 1
    assert keys_of(db, f"choice_unscoped_{framework}", "") >= 1


@pytest.mark.parametrize("path", ["/empty", "/empty-phased"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.slow
def test_a_scope_function_that_returns_an_empty_scope_is_refused_and_stores_nothing(
    servers: dict[str, str],
    db: sa.Engine,
    framework: str,
    path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    item = new_item()
    with caplog.at_level(logging.ERROR, logger="recoverypoint.http"):
        answer = post(servers, framework, path, item, {"Idempotency-Key": item})

    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith(":configuration-error")
    assert runs(db, item) == 0
    kind = "single" if path == "/empty" else ""
    operation = f"choice_empty_{kind + '_' if kind else ''}{framework}"
    assert keys_of(db, operation) == 0
    assert any("empty scope" in r.getMessage() for r in caplog.records)


def test_a_scope_that_is_neither_a_function_nor_unscoped_is_refused(db: sa.Engine) -> None:
    engine = rp.Engine(db)
    for scope in ("", None, "tenant", 0):
        with pytest.raises(ValueError, match="UNSCOPED"):
            rp_fastapi.Idempotency(engine, scope=scope)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="UNSCOPED"):
            rp_flask.Idempotency(engine, scope=scope)  # type: ignore[arg-type]


# -- hostile configuration and input ---------------------------------------------------------

_TOKEN = st.from_regex(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", fullmatch=True)
_NAMES = st.one_of(
    _TOKEN,
    st.text(max_size=100),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=65, max_size=300),
    st.sampled_from(["", " ", "Idempotency Key", "X-Key\r\nX-Evil: 1", "X\x00", "Content-Length"]),
    st.integers(),
    st.none(),
    st.binary(max_size=10),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(key_header=_NAMES, replayed_header=_NAMES)
def test_header_names_are_tokens_or_refused_with_a_value_error(
    key_header: Any, replayed_header: Any
) -> None:
    engine: Any = rp.Engine.__new__(rp.Engine)  # no database is needed to refuse a name
    try:
        made = BaseIdempotency(
            engine, scope=UNSCOPED, key_header=key_header, replayed_header=replayed_header
        )
    except ValueError as exc:
        assert "header" in str(exc)
        return
    for name in (made.key_header, made.replayed_header):
        assert isinstance(name, str) and 1 <= len(name) <= 64
        assert name.isascii() and name.isprintable() and " " not in name
    assert made.key_header.lower() != made.replayed_header.lower()


@settings(max_examples=200)
@given(
    classes=st.one_of(
        st.lists(st.integers(-10, 10), max_size=6),
        st.lists(st.one_of(st.booleans(), st.floats(), st.text(max_size=2)), max_size=3),
        st.text(max_size=4),
        st.integers(),
        st.none(),
    )
)
def test_stored_classes_are_some_of_2_to_5_or_refused(classes: Any) -> None:
    engine: Any = rp.Engine.__new__(rp.Engine)
    try:
        made = BaseIdempotency(engine, scope=UNSCOPED, stored_classes=classes)
    except ValueError as exc:
        assert "stored_classes" in str(exc)
        return
    assert made.stored_classes and made.stored_classes <= {2, 3, 4, 5}
    assert all(type(c) is int for c in made.stored_classes)


@settings(max_examples=200)
@given(
    name=_TOKEN,
    lines=st.lists(st.text(max_size=40), max_size=3),
)
def test_a_chosen_key_header_is_named_in_every_refusal(name: str, lines: list[str]) -> None:
    try:
        read_key(lines, name)
    except rp.InvalidKey as exc:
        assert name in exc.message or "idempotency key" in exc.message


@settings(max_examples=200)
@given(
    returned=st.one_of(
        st.just(""),
        st.text(max_size=300),
        st.integers(),
        st.none(),
        st.binary(max_size=5),
    )
)
@pytest.mark.slow
def test_a_scope_function_never_raises_and_never_yields_an_empty_scope(returned: Any) -> None:
    engine: Any = rp.Engine.__new__(rp.Engine)
    made: BaseIdempotency[Request] = BaseIdempotency(engine, scope=lambda request: returned)
    scope = made._scope_of(Request({"type": "http"}), "in the test", ())
    if isinstance(scope, Reply):
        assert scope.status == 500
    else:
        assert scope == returned and scope != ""


# -- docs/how-to/http.md, its choices' example, word for word --------------------------------


@pytest.mark.slow
def test_the_docs_choices_example(
    database_url: str, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    [example] = [
        b.body
        for b in blocks(page("how-to/http.md"))
        if b.mark_value == "tests/test_http_choices.py"
    ]
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)
    namespace: dict[str, Any] = {"__name__": "readme_choices"}
    exec(compile(example, "how-to/http.md", "exec"), namespace)
    with serve_wsgi(namespace["app"]) as base_url:
        key = uuid.uuid4().hex
        sent = {"X-Request-Id": key}
        first, again = (client.post(f"{base_url}/pings", headers=sent) for _ in "ab")
        keyless = client.post(f"{base_url}/pings")
    assert first.json() == again.json() == keyless.json() == {"pong": "yes"}
    assert again.headers["X-Replayed"] == "true" and "x-replayed" not in first.headers
    assert keyless.headers["Idempotent-Unprotected"] == "true"
    assert count(db, "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = :k", k=key) == 1
    namespace["engine"].dispose()


@pytest.mark.slow
@settings(
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    values=st.lists(
        st.text(
            alphabet=st.characters(
                min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"
            ),
            max_size=300,
        ),
        min_size=1,
        max_size=3,
    ),
    framework=st.sampled_from(FRAMEWORKS),
)
def test_any_value_of_the_renamed_key_header_is_answered_never_a_500(
    servers: dict[str, str], db: sa.Engine, values: list[str], framework: str
) -> None:
    item = new_item()
    # As bytes: any latin-1 value a client may send, not only what httpx would encode
    # (HTTP/1.1 drops a value's surrounding whitespace; h11 refuses to send it).
    headers = [(KEY_HEADER.encode(), v.strip(" \t").encode("latin-1")) for v in values]
    headers.append((b"X-Tenant", item.encode()))
    answer = client.post(
        servers[framework] + "/answer/201", json={"item": item}, headers=headers, timeout=60
    )
    assert answer.status_code in (201, 400), answer.text
    if answer.status_code == 400:
        assert runs(db, item) == 0
        assert keys_of(db, f"choice_answer_{framework}", item) == 0
    else:
        assert runs(db, item) == 1
