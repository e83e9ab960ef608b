"""The pure rules of recoverypoint.keys, each at its boundary: no database."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recoverypoint.engine.context import KeyIdentity
from recoverypoint.errors import InvalidKey, InvalidParams, RequestTooLarge
from recoverypoint.keys import (
    MAX_JSON_DEPTH,
    MAX_KEY_LENGTH,
    MAX_PATH_LENGTH,
    MAX_SCOPE_LENGTH,
    canonical_json,
    check_depth,
    check_size,
    derived_key_of,
    fingerprint,
    key_seed,
    legacy_key_material,
    record_material,
    safe_headers,
    validate_key,
    validate_namespace,
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


def _depth(value: object) -> int:
    """How deeply arrays and objects nest in ``value``, by the definition, recursively."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list | tuple):
        return 1 + max(map(_depth, value), default=0)
    return 0


NESTED_VALUES = st.recursive(
    st.none() | st.integers() | st.text(max_size=2),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(NESTED_VALUES, st.integers(min_value=0, max_value=6))
def test_check_depth_refuses_exactly_the_values_nested_deeper_than_the_limit(
    value: object, limit: int
) -> None:
    # The walk takes only containers onto its stack; a value's depth is still every path's.
    if _depth(value) > limit:
        with pytest.raises(InvalidParams):
            check_depth(value, limit)
    else:
        check_depth(value, limit)


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


@settings(max_examples=300)
@given(JSON_VALUES)
@pytest.mark.slow
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


def test_a_fingerprint_stored_by_an_earlier_release_still_matches() -> None:
    # A stored key is judged by its fingerprint: one computed otherwise than before would
    # make every retry of a key in flight across an upgrade a ParamsMismatch. Computed
    # with 0.1.0's code (SHA-256 of the upper-cased method, the path and the params' JSON,
    # each followed by a NUL).
    assert (
        fingerprint("POST", "/rides", '{"origin_lat":37.7749,"origin_lon":-122.4194}')
        == "fc05d2841800f09fc47182f22bd72cd1cf44fdfed836d34e67d887916c26615d"
    )
    assert (
        fingerprint("post", "/caf\u00e9/\u2603", '{"k":"\U0001f600"}')
        == "ab60e4b32545c7da677a8c2eb96084821074f527551eab3dca031eba2fa5677d"
    )


def test_fingerprints_tell_every_part_of_the_request_apart() -> None:
    base = fingerprint("POST", "/a", "{}")
    assert fingerprint("post", "/a", "{}") == base
    assert len({base, fingerprint("PUT", "/a", "{}"), fingerprint("POST", "/b", "{}")}) == 3
    assert fingerprint("POST", "/a", "{}x") != fingerprint("POST", "/a{", "}x")
    assert fingerprint("POST", "/a", "{}") != fingerprint("POST", "/a", '{"a":1}')


def test_seeds_depend_on_the_namespace_and_every_part_of_what_the_client_sent() -> None:
    seed = key_seed("ns", "acct_1", "rides", "k-1")
    others = {
        key_seed("other-ns", "acct_1", "rides", "k-1"),
        key_seed("ns", "acct_2", "rides", "k-1"),
        key_seed("ns", "acct_1", "orders", "k-1"),
        key_seed("ns", "acct_1", "rides", "k-2"),
        # NUL separates the parts: no two splits of the same characters meet.
        key_seed("ns", "acct_1r", "ides", "k-1"),
    }
    assert seed not in others and len(others) == 5
    assert "acct_1" not in seed and "k-1" not in seed


def test_derived_keys_depend_on_the_material_the_kind_and_every_name() -> None:
    seed = key_seed("ns", "", "rides", "k")
    key = derived_key_of(seed, "downstream", "charged", "")
    others = {
        derived_key_of(seed, "job", "charged", ""),
        derived_key_of(seed, "downstream", "refunded", ""),
        derived_key_of(seed, "downstream", "charged", "2"),
        derived_key_of(key_seed("ns", "", "rides", "k2"), "downstream", "charged", ""),
    }
    assert key not in others and len(others) == 4
    assert key.startswith("rp_") and len(key) == 67


def test_a_record_without_a_seed_derives_from_its_id_and_instant_in_any_time_zone() -> None:
    at = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
    material = record_material(None, 7, at, "rides")
    same_instant = at.astimezone(timezone(timedelta(hours=5)))
    assert record_material(None, 7, same_instant, "rides") == material
    others = {
        record_material(None, 8, at, "rides"),
        record_material(None, 7, at + timedelta(microseconds=1), "rides"),
        record_material(None, 7, at, "orders"),
    }
    assert material not in others and len(others) == 3
    assert record_material("a-seed", 7, at, "rides") == "a-seed"


def test_derived_keys_never_change_between_releases() -> None:
    # A foreign system has these keys already: a key derived otherwise by a new release,
    # for a request an old one began, would charge again. Pinned both ways: a record claimed
    # before seeds existed (by its id and creation time), and one with a seed. Also checks
    # the record's cached part (KeyIdentity) against the plain functions.
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    legacy = "rp_7d9512b97555ebb9b4efae97a4a33939fe18ba6a991beaed6a59321f2ed38b98"
    assert derived_key_of(legacy_key_material(7, at, "rides"), "downstream", "charged", "") == (
        legacy
    )
    assert KeyIdentity("rides", 7, at, None).derive("downstream", "charged", "") == legacy
    seed = key_seed("3f0c", "acct_1", "rides", "k-1")
    seeded = "rp_434752542446072b258b883a4478e5e46bdec9e087a3d0935a7cfc40cdbc12bd"
    assert derived_key_of(seed, "downstream", "charged", "") == seeded
    identity = KeyIdentity("rides", 7, at, seed)
    assert identity.derive("downstream", "charged", "") == seeded
    # A key reused after its retention (recoverypoint.generations): generation 0 derives
    # the keys above, every later one its own.
    assert KeyIdentity("rides", 7, at, seed, 0).derive("downstream", "charged", "") == seeded
    reused = "rp_67aaeafb232722f8de52b7fdf13efad5dd4aca6492729950419192969d07bc32"
    assert KeyIdentity("rides", 7, at, seed, 1).derive("downstream", "charged", "") == reused
    with pytest.raises(AttributeError, match="read-only"):
        identity.key_id = 8  # type: ignore[misc]


@pytest.mark.parametrize("namespace", ["", "x" * 256, "a\x00b", "\ud800", 7, None])
def test_a_namespace_that_cannot_set_keys_apart_is_refused(namespace: object) -> None:
    with pytest.raises(ValueError, match="namespace"):
        validate_namespace(namespace)


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
