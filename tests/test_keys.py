"""The pure rules of recoverypoint.keys, each at its boundary: no database."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recoverypoint.context import KeyIdentity
from recoverypoint.errors import InvalidKey, InvalidParams, RequestTooLarge
from recoverypoint.keys import (
    MAX_JSON_DEPTH,
    MAX_KEY_LENGTH,
    MAX_PATH_LENGTH,
    MAX_SCOPE_LENGTH,
    canonical_json,
    check_depth,
    check_size,
    derived_key,
    fingerprint,
    safe_headers,
    validate_key,
    validate_request,
    validate_scope,
)


def test_keys_are_printable_ascii_up_to_the_limit() -> None:
    assert validate_key("k" * MAX_KEY_LENGTH) == "k" * MAX_KEY_LENGTH
    assert validate_key(" ~") == " ~"
    for bad in ("", "k" * (MAX_KEY_LENGTH + 1), "a\x7f", "\x1fa", "ok\x00", "é", None, 1):
        with pytest.raises(InvalidKey):
            validate_key(bad)


def test_scopes_are_strings_up_to_the_limit_without_nul() -> None:
    assert validate_scope("") == ""
    assert validate_scope("s" * MAX_SCOPE_LENGTH) == "s" * MAX_SCOPE_LENGTH
    for bad in ("s" * (MAX_SCOPE_LENGTH + 1), "\x00", "a\x00", "\ud800", None):
        with pytest.raises(ValueError):
            validate_scope(bad)


def test_requests_are_an_http_method_and_a_storable_path() -> None:
    assert validate_request("post", "/rides") == ("POST", "/rides")
    assert validate_request("GET", "/" * MAX_PATH_LENGTH) == ("GET", "/" * MAX_PATH_LENGTH)
    with pytest.raises(RequestTooLarge):
        validate_request("GET", "/" * (MAX_PATH_LENGTH + 1))
    for method, path in (("PO ST", "/"), ("", "/"), ("GET", "/\x00"), ("GET", "/\ud800")):
        with pytest.raises(InvalidParams):
            validate_request(method, path)


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_params_may_nest_up_to_the_limit() -> None:
    check_depth(nested(MAX_JSON_DEPTH))
    check_depth({"a": nested(MAX_JSON_DEPTH - 1)})
    with pytest.raises(InvalidParams):
        check_depth(nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(InvalidParams):
        check_depth({"a": nested(MAX_JSON_DEPTH)})


def test_canonical_json_is_sorted_compact_and_refuses_what_postgresql_cannot_store() -> None:
    assert canonical_json({"b": 1, "a": [1.5, "é"]}) == '{"a":[1.5,"é"],"b":1}'
    # A backslash followed by the text u0000 is no NUL; a NUL after a backslash is one.
    assert canonical_json("\\u0000") == '"\\\\u0000"'
    for bad in ("\x00", "a\\\x00", float("nan"), float("inf"), "\ud800", {1j}):
        with pytest.raises(ValueError):
            canonical_json(bad)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_canonical_json_is_the_text_json_dumps_gives(value: object) -> None:
    # Fingerprints of keys already stored hash this text: its encoder may change, the text
    # never (a key retried across a deploy would otherwise be refused as another request).
    # Lone surrogates, which both refuse, aside.
    expected = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    try:
        expected.encode()
    except UnicodeEncodeError:
        with pytest.raises(ValueError, match="lone surrogate"):
            canonical_json(value)
        return
    if holds_nul(value):
        with pytest.raises(ValueError, match="NUL"):
            canonical_json(value)
        return
    assert canonical_json(value) == expected


def holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    return False


def test_a_value_that_holds_itself_is_refused() -> None:
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="holding itself"):
        canonical_json(loop)


def test_size_is_counted_in_bytes_up_to_the_limit() -> None:
    check_size("é" * 5, 10)
    with pytest.raises(RequestTooLarge):
        check_size("é" * 5, 9)


def test_fingerprints_tell_every_part_of_the_request_apart() -> None:
    base = fingerprint("POST", "/a", "{}")
    assert fingerprint("post", "/a", "{}") == base
    assert len({base, fingerprint("PUT", "/a", "{}"), fingerprint("POST", "/b", "{}")}) == 3
    assert fingerprint("POST", "/a", "{}x") != fingerprint("POST", "/a{", "}x")
    assert fingerprint("POST", "/a", "{}") != fingerprint("POST", "/a", '{"a":1}')


def test_derived_keys_depend_on_every_stored_field_and_no_time_zone() -> None:
    at = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
    key = derived_key("downstream", 7, at, "charged", operation="rides")
    same_instant = at.astimezone(timezone(timedelta(hours=5)))
    assert derived_key("downstream", 7, same_instant, "charged", operation="rides") == key
    others = {
        derived_key("job", 7, at, "charged", operation="rides"),
        derived_key("downstream", 8, at, "charged", operation="rides"),
        derived_key("downstream", 7, at + timedelta(microseconds=1), "charged", operation="rides"),
        derived_key("downstream", 7, at, "refunded", operation="rides"),
        derived_key("downstream", 7, at, "charged", "2", operation="rides"),
        derived_key("downstream", 7, at, "charged", operation="orders"),
    }
    assert key not in others and len(others) == 6
    assert key.startswith("rp_") and len(key) == 67


def test_derived_keys_never_change_between_releases() -> None:
    # A foreign system has these keys already: a key derived otherwise by a new release,
    # for a request an old one began, would charge again. Also checks the record's cached
    # part (KeyIdentity) against the plain function.
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    known = "rp_7d9512b97555ebb9b4efae97a4a33939fe18ba6a991beaed6a59321f2ed38b98"
    assert derived_key("downstream", 7, at, "charged", "", operation="rides") == known
    identity = KeyIdentity("rides", 7, at)
    assert identity.derive("downstream", "charged", "") == known
    with pytest.raises(AttributeError, match="read-only"):
        identity.key_id = 8  # type: ignore[misc]


def test_safe_headers_drop_cookies_and_hop_by_hop_headers_in_any_case() -> None:
    headers = {
        "Location": "/rides/1",
        "Set-Cookie": "a=b",
        "CONTENT-LENGTH": "12",
        "Connection": "close",
        "Transfer-Encoding": "chunked",
    }
    assert safe_headers(headers) == {"Location": "/rides/1"}
    assert safe_headers(None) == {} and safe_headers({}) == {}
