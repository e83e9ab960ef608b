"""Hostile input to the console's query strings and forms: odd unicode, bytes that are not
UTF-8, NUL, huge and negative numbers, very long values, a parameter given twice, names
nobody expects. Whatever comes, the answer is a page (200) or a refusal (4xx): never a
500, never a traceback, SQL or the driver's words that the request did not itself carry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import pytest
from console_site import LEAKS, MOUNT, Provider, app_for, client, console_database, engine_for
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from workload import plant_keys

pytestmark = pytest.mark.slow  # hypothesis over the console's forms and queries

HOSTILE = settings(
    database=None,  # no .hypothesis directory in the checkout
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FIELDS = [
    "q",
    "operation",
    "version",
    "scope",
    "state",
    "point",
    "status",
    "since",
    "limit",
    "before",
    "name",
    "key_id",
    "failing",
    "ids",
    "csrf",
    "response_status",
    "message",
    "reset_attempts",
    "show",
    "next",
]
VALUES = st.one_of(
    st.binary(max_size=40),  # not necessarily UTF-8
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),  # lone surrogates too
    st.integers(min_value=-(2**80), max_value=2**80).map(lambda n: str(n).encode()),
    st.sampled_from(
        [
            b"\x00",
            b"stuck\x00",
            b"1e9",
            b"0x10",
            b"",
            b" ",
            b"\xff\xfe",
            b"%00",
            b"9" * 400,
            b"x" * 20_000,
            b"1,2,,3",
            b"1," * 1500,
            b"\xed\xa0\x80",
            b"' OR 1=1 --",
            b"<script>alert(1)</script>",
            b"{{ 7*7 }}",
        ]
    ),
)
PAIRS = st.lists(
    st.tuples(st.one_of(st.sampled_from(FIELDS), st.binary(max_size=8)), VALUES), max_size=8
)
GOOD = {200, 303, 400, 403, 404, 409}


@pytest.fixture(scope="module")
def app(module_database_url: str) -> Iterator[Any]:
    with console_database(module_database_url) as db:
        plant_keys(db, "charges", 30, point="reserved", next_attempt_at="now() - interval '1 hour'")
        yield app_for(engine_for(db, Provider()))


def encoded(pairs: list[tuple[bytes | str, bytes]]) -> str:
    return "&".join(
        f"{quote_from_bytes(n if isinstance(n, bytes) else n.encode())}={quote_from_bytes(v)}"
        for n, v in pairs
    )


def sent_text(pairs: list[tuple[bytes | str, bytes]]) -> str:
    return " ".join(
        (n if isinstance(n, str) else n.decode("utf-8", "replace")) + v.decode("utf-8", "replace")
        for n, v in pairs
    )


def assert_safe(response: Any, pairs: list[tuple[bytes | str, bytes]]) -> None:
    assert response.status_code in GOOD, (response.status_code, response.text[-600:])
    leak = LEAKS.search(response.text)
    assert leak is None or leak.group(0) in sent_text(pairs), leak


@HOSTILE
@given(
    path=st.sampled_from(
        [
            "/",
            "/keys",
            "/jobs",
            "/audit",
            "/keys/1",
            "/keys/1/abandon",
            "/keys/bulk/retry",
            "/keys/bulk/nope",
            "/audit/1",
        ]
    ),
    pairs=PAIRS,
)
@example(path="/keys", pairs=[("state", b"stuck"), ("state", b"stuck"), ("state", b"x")])
@example(path="/keys", pairs=[("version", b"99999999999999999999")])
@example(path="/keys", pairs=[("q", b"a\x00b")])
@example(path="/keys", pairs=[("before", b"9223372036854775808")])
@example(path="/keys", pairs=[("operation", b"a"), ("operation", b"b")])
@example(path="/jobs", pairs=[("key_id", b"-1")])
@example(path="/keys/bulk/retry", pairs=[("q", b"\xed\xa0\x80")])
def test_hostile_query_strings_get_a_page_or_a_refusal(
    app: Any, path: str, pairs: list[tuple[bytes | str, bytes]]
) -> None:
    url = f"{MOUNT}{path}?{encoded(pairs)}"
    # No client sends a longer URL (httpx refuses it; servers' own limits are lower).
    assume(len(url) <= 65_536)
    with client(app, "operator") as browser:
        response = browser.get(url)
    assert_safe(response, pairs)


@HOSTILE
@given(
    path=st.sampled_from(
        ["/keys/bulk/abandon", "/keys/bulk/retry", "/keys/2/release", "/keys/3/abandon", "/reveal"]
    ),
    pairs=PAIRS,
)
@example(path="/keys/bulk/abandon", pairs=[("operation", b"charges"), ("ids", b"1," * 1500)])
@example(path="/keys/bulk/retry", pairs=[("operation", b"charges"), ("ids", b"-1")])
@example(path="/keys/3/abandon", pairs=[("response_status", b"200"), ("message", b"\x00")])
@example(path="/keys/3/abandon", pairs=[("response_status", b"503"), ("response_status", b"500")])
def test_hostile_forms_with_a_valid_token_get_a_page_or_a_refusal(
    app: Any, path: str, pairs: list[tuple[bytes | str, bytes]]
) -> None:
    with client(app, "operator") as browser:
        browser.get(f"{MOUNT}/keys")
        token = browser.cookies["rp_console_csrf"]
        body = encoded([("csrf", token.encode()), *pairs])
        response = browser.post(
            f"{MOUNT}{path}",
            content=body.encode(),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert_safe(response, pairs)
