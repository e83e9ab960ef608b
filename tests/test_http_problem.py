"""The HTTP contract without a server: reading the key, errors as problem+json, replays."""

from __future__ import annotations

import base64
import json
from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import recoverypoint as rp
from recoverypoint.integrations._base import Captured, stored_reply
from recoverypoint.integrations._problem import outcome_reply, problem_reply, read_key
from recoverypoint.integrations._sfv import BareItem, Item, ParseError, Token, parse_item
from recoverypoint.keys import canonical_json

# No example database: no .hypothesis directory in the checkout.
PROPERTIES = settings(database=None)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        (["8e03978e-40d5"], "8e03978e-40d5"),
        ([" 8e03978e-40d5 "], "8e03978e-40d5"),
        (['"8e03978e-40d5"'], "8e03978e-40d5"),
        (['"a\\"b\\\\c"'], 'a"b\\c'),
        (['"a,b"'], "a,b"),
        (['"a b; c=d"'], "a b; c=d"),
        (['"abc";p=1;q'], "abc"),
        (['  "abc";p=-1.5;q=?0;r=:YWJj:;s=tok/x;t="str";u=?1;v;*w=12  '], "abc"),
        (['"abc"; p=1;  q'], "abc"),  # spaces before a parameter's key are allowed
        (['"abc";p=1;p=2'], "abc"),
        # Bare (Stripe's form): a Token, or not an Item at all; its text is the key.
        (["key-1"], "key-1"),
        (["a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d"], "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d"),
        (["8e03978e-40d5-43e8-bc93-6894a57f9324"], "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (["1234567890123456"], "1234567890123456"),  # 16 digits: no Integer
        (["?x"], "?x"),
        (["a=b"], "a=b"),
        # Two lines are one field: these two make one String, as RFC 8941 reads them.
        (['"a', 'b"'], "a, b"),
    ],
    ids=repr,
)
def test_keys_are_read_as_sf_strings_or_bare(values: list[str], key: str) -> None:
    assert read_key(values) == key


@pytest.mark.parametrize(
    "values",
    [
        [],
        [""],
        ["  "],
        ['""'],
        ["a", "b"],
        ['"a"', '"b"'],
        ['"a", "b"'],
        ["a,b"],
        ['"a'],
        ['"a"b"'],
        ["k" * 256],
        ["tab\there"],
        ['"abc"\t'],  # RFC 8941 discards spaces, not tabs
        ['"a\x01b"'],
        ['"caf\u00e9"'],
        ["caf\u00e9"],
        ['"a\\nb"'],  # \n is no sf-string escape
        # Items of other types, which the draft forbids
        ["?1"],
        ["?0"],
        [":YWJj:"],
        ["12"],
        ["-12"],
        ["1.5"],
        ["key;p=1"],
        # Parameters with bad syntax
        ['"abc";'],
        ['"abc";P=1'],
        ['"abc";1p=1'],
        ['"abc";p='],
        ['"abc";p=?2'],
        ['"abc";p=:!!:'],
        ['"abc";p="x'],
        ['"abc" ;p=1'],
        ['"abc";p=1 x'],
        ['"abc";p=1.2345'],
        ['"abc";p=1234567890123456'],
    ],
    ids=repr,
)
def test_missing_repeated_or_invalid_keys_are_refused(values: list[str]) -> None:
    with pytest.raises(rp.InvalidKey):
        read_key(values)


# Header lines as a server decodes them (latin-1), and near-misses of the grammar.
header_lines = st.lists(
    st.one_of(
        st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=300),
        st.from_regex(r'[0-9a-z.:?";=*\- ]{0,40}', fullmatch=True),
    ),
    max_size=3,
)


@PROPERTIES
@given(header_lines)
@example(["9" * 10_000])
@example(['"' + "a" * 100_000 + '"'])
@example(["a;" + ";".join(f"p{i}=1" for i in range(5_000))])
def test_any_header_lines_give_a_key_or_invalid_key_and_nothing_else(values: list[str]) -> None:
    # The FastAPI middleware reads the key before the body, outside the engine's refusals:
    # anything but InvalidKey would escape it as a bare 500.
    try:
        key = read_key(values)
    except rp.InvalidKey:
        return
    assert 1 <= len(key) <= 255


# -- the Structured Field parser, against the RFC 8941 grammar --------------------------

# sf-string characters (RFC 8941 §3.3.3): printable ASCII; '"' and '\' are escaped.
sf_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E))
tokens = st.from_regex(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]{0,20}", fullmatch=True).map(Token)
bare_items: st.SearchStrategy[BareItem] = st.one_of(
    st.integers(-(10**15) + 1, 10**15 - 1),
    st.decimals(-(10**12) + 1, 10**12 - 1, places=3, allow_nan=False, allow_infinity=False),
    sf_text,
    tokens,
    st.binary(max_size=20),
    st.booleans(),
)
param_keys = st.from_regex(r"[a-z*][a-z0-9_\-.*]{0,8}", fullmatch=True)
parameters = st.dictionaries(param_keys, bare_items, max_size=4)
spaces = st.text(" ", max_size=3)


def serialize_bare_item(value: BareItem) -> str:
    """RFC 8941 §4.1.3."""
    if isinstance(value, bool):
        return "?1" if value else "?0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Decimal):
        whole, _, fraction = f"{abs(value.quantize(Decimal('0.001'))):f}".partition(".")
        return f"{'-' if value < 0 else ''}{whole}.{fraction.rstrip('0') or '0'}"
    if isinstance(value, Token):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f":{base64.b64encode(value).decode()}:"


def serialize_item(value: BareItem, params: dict[str, BareItem]) -> str:
    """RFC 8941 §4.1.3 and §4.1.1.2: a parameter that is true is written without a value."""
    written = [
        f";{key}" if v is True else f";{key}={serialize_bare_item(v)}" for key, v in params.items()
    ]
    return serialize_bare_item(value) + "".join(written)


def typed(item: Item) -> object:
    """``item`` with each value's type, so that ``True`` is not ``1`` nor a Token a String."""
    value, params = item
    return (type(value), value), [(k, type(v), v) for k, v in params.items()]


@PROPERTIES
@given(sf_text, parameters, spaces, spaces)
@example('a"b\\c', {"p": 1, "q": True}, "", "")
def test_any_sf_string_with_any_parameters_is_the_key(
    text: str, params: dict[str, BareItem], before: str, after: str
) -> None:
    field = before + serialize_item(text, params) + after

    assert typed(parse_item(field)) == typed((text, params))
    if 1 <= len(text) <= 255:
        assert read_key([field]) == text
    else:
        with pytest.raises(rp.InvalidKey):
            read_key([field])


@PROPERTIES
@given(bare_items, parameters)
@pytest.mark.slow
def test_items_round_trip(value: BareItem, params: dict[str, BareItem]) -> None:
    assert typed(parse_item(serialize_item(value, params))) == typed((value, params))


@PROPERTIES
@given(st.one_of(st.uuids(version=4).map(str), tokens))
def test_a_bare_uuid_or_token_is_its_own_key_quoted_or_not(key: str) -> None:
    assert read_key([key]) == read_key([serialize_bare_item(str(key))]) == key


grammar_soup = st.text(st.sampled_from(' \t"\\;=,:?*-.+/019aAzZ_()\x00\x7f\u00e9'), max_size=30)


@PROPERTIES
@given(st.lists(st.one_of(st.text(max_size=30), grammar_soup), max_size=3))
@example(['"' + "\\" * 3])
@example([":" + "=" * 5 + ":"])
def test_no_header_makes_read_key_raise_anything_but_invalid_key(values: list[str]) -> None:
    try:
        key = read_key(values)
    except rp.InvalidKey:
        return
    # What it accepts is a usable key: a String's value, or a bare key as read_key says.
    assert rp.keys.validate_key(key) == key
    try:
        value: BareItem | None = parse_item(", ".join(values))[0]
    except ParseError:
        value = None
    if value is None or isinstance(value, Token):
        assert len(values) == 1 and key == values[0].strip(" ")
        assert not set(key) & set(' \t,;"')
    else:
        assert value == key


# -- single-step bodies, kept and replayed byte for byte ----------------------------------


@PROPERTIES
@given(st.binary(max_size=300) | st.text(max_size=100).map(str.encode))
@example(b'{"z":1,"a":1e16,"n":NaN}')
@example(b'{"a":"\\u0000"}')
@example(b"\x00")
@example(b"\xff\xfe")
def test_any_single_step_body_is_stored_in_jsonb_and_replayed_as_it_was(body: bytes) -> None:
    stored = Captured(200, [("Content-Digest", "d"), ("Set-Cookie", "s")], body).stored()
    # As it comes back from the database: canonical JSON, which jsonb accepts.
    stored = json.loads(canonical_json(stored))
    reply = stored_reply(rp.Outcome(200, stored["body"], stored["headers"], replayed=True))

    assert reply.body == body
    assert reply.headers == [("Content-Digest", "d"), ("Idempotent-Replayed", "true")]


def test_a_body_stored_as_a_json_value_still_replays() -> None:
    """Keys finished before bodies were kept as bytes, and the completer's abandoned keys."""
    outcome = rp.Outcome(500, {"error": "request_abandoned"}, {}, replayed=True)
    reply = stored_reply(outcome)
    assert json.loads(reply.body) == {"error": "request_abandoned"}
    assert ("Idempotent-Replayed", "true") in reply.headers


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (rp.InvalidKey(), 400, None),
        (rp.InvalidParams("the item is missing"), 422, None),
        (rp.ParamsMismatch(), 422, None),
        (rp.RequestTooLarge(), 413, None),
        (rp.KeyInUse(retry_after=80), 409, "2"),
        (rp.KeyInUse(retry_after=1), 409, "1"),
        (rp.LockLost(), 409, "2"),
        (rp.ConcurrentUpdate(), 409, "2"),
        (rp.Retryable("db at 10.0.0.1 down"), 503, "2"),
        (rp.OperationNotRegistered("op x at /srv/app"), 500, None),
        (KeyError("/srv/app/secret"), 500, None),
    ],
)
def test_errors_become_problems_with_the_drafts_statuses(
    error: Exception, status: int, retry_after: str | None
) -> None:
    reply = problem_reply(error, retry_after=2)
    headers = dict(reply.headers)
    body = json.loads(reply.body)

    assert reply.status == body["status"] == status
    assert headers["Content-Type"] == "application/problem+json"
    assert headers.get("Retry-After") == retry_after
    assert body["type"].startswith("tag:recoverypoint,2025:") and body["title"]
    if status >= 500:  # never the message: phase code may have put internals there
        assert "10.0.0.1" not in reply.body.decode() and "/srv/app" not in reply.body.decode()
    else:
        assert body["detail"] == " ".join(str(error).split())


def test_a_500_tells_the_client_to_retry_with_the_same_key() -> None:
    body = json.loads(problem_reply(RuntimeError("boom"), retry_after=1).body)
    assert "same Idempotency-Key" in body["detail"]


def test_replays_are_marked_and_bodies_follow_their_status_and_type() -> None:
    replay = outcome_reply(rp.Outcome(201, {"id": 1}, {"X-Id": "1"}, replayed=True))
    assert dict(replay.headers) == {
        "X-Id": "1",
        "Idempotent-Replayed": "true",
        "Content-Type": "application/json",
    }
    assert json.loads(replay.body) == {"id": 1}

    empty = outcome_reply(rp.Outcome(204, None, {"Content-Type": "x/y"}, replayed=False))
    assert (empty.body, empty.headers) == (b"", [])

    text = outcome_reply(rp.Outcome(200, "hi", {"Content-Type": "text/plain"}, replayed=False))
    assert text.body == b"hi"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (rp.TransactionEnded("COMMIT in /srv/app/views.py"), "transaction-ended"),
        (rp.PhaseLeftScope("shard 102008 at 10.0.0.1"), "phase-left-scope"),
    ],
)
def test_a_phase_at_fault_says_no_retry_helps_and_nothing_of_its_insides(
    error: Exception, kind: str
) -> None:
    reply = problem_reply(error, retry_after=2)
    body = json.loads(reply.body)
    assert (reply.status, body["type"]) == (500, f"tag:recoverypoint,2025:{kind}")
    assert "will not help" in body["detail"] and "Retry-After" not in dict(reply.headers)
    assert "10.0.0.1" not in reply.body.decode() and "/srv/app" not in reply.body.decode()
