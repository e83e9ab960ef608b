"""Hostile input, thrown at ``Engine.run`` and at both HTTP integrations, phased routes and
single-step endpoints alike, on the real PostgreSQL. Whatever a client sends:

- it never gets a 5xx (``Engine.run`` raises only 4xx :class:`~recoverypoint.IdempotencyError`
  for bad input: never ``UnicodeEncodeError``, ``RecursionError``, a driver error...);
- no answer shows the server's insides (tracebacks, driver or SQL text, file paths);
- a refused request (4xx) leaves no key record in its scope and did no work;
- the same request again gets the same status and the same body bytes, a replay says so
  (``Idempotent-Replayed: true``), and the work ran at most once;
- no answer crosses scopes: the same key in two scopes is two requests, each run once.

Every example uses fresh scopes (tenants), so examples never see each other's keys. The
services are in ``hostile_apps.py``; they count every run of their work per tenant.

When the server answers 5xx, the assertion is raised *from* the exception the server
logged, so that hypothesis tells different server failures apart and reports each.
"""

from __future__ import annotations

import json
import logging
import re
import string
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from hostile_apps import (
    CURRENT,
    REQUEST_ID,
    RUNS,
    TENANT,
    echo_operation,
    fastapi_app,
    flask_app,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from testclient import TestClient

import recoverypoint as rp

# -- settings --------------------------------------------------------------------------------

# No example database: the file must not leave a .hypothesis directory in the checkout,
# and each run starts from the explicit examples and fresh draws.
HOSTILE = settings(
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# What a server's insides look like in an answer: tracebacks, driver and ORM names, file
# paths, SQL, Python exception names. An answer may show them only if the client sent them.
INTERNALS = [
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"traceback",
        r"psycopg",
        r"sqlalchemy",
        r"site-packages",
        r"/(?:home|usr|opt|srv|root|work|tmp)/",
        r"\.py\b",
        r'file "',
        r"\bidempotency_keys\b",
        r"\binsert\s+into\b",
        r"\bselect\b.+\bfrom\b",
        r"\bupdate\b.+\bset\b",
        r"\bon\s+conflict\b",
        r"sqlstate",
    )
] + [re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b")]  # a Python exception's name

PROBLEM = "application/problem+json"
DEEP = sys.getrecursionlimit() + 100  # nesting beyond the interpreter's recursion limit


# -- hostile values, lazily built so that hypothesis can print them -------------------------


class Blob(bytes):
    """Bytes whose repr stays short, for huge or deep bodies in hypothesis' reports."""

    def __repr__(self) -> str:
        if len(self) <= 80:
            return f"Blob({bytes(self)!r})"
        return f"Blob({bytes(self[:40])!r} ... {len(self)} bytes)"


@dataclass(frozen=True)
class Deep:
    """Lists nested ``depth`` deep around ``inner``; built without recursion."""

    depth: int
    inner: Any = None

    def build(self) -> Any:
        value = self.inner
        for _ in range(self.depth):
            value = [value]
        return value


@dataclass(frozen=True)
class Huge:
    """A dict with one string of ``size`` characters."""

    size: int
    char: str = "x"

    def build(self) -> Any:
        return {"blob": self.char * self.size}


def built(value: Any) -> Any:
    return value.build() if isinstance(value, Deep | Huge) else value


def deep_json(depth: int) -> Blob:
    return Blob(b"[" * depth + b"1" + b"]" * depth)


# -- strategies: Python values for Engine.run -------------------------------------------------

# Every character, lone surrogates included (hypothesis leaves them out by default).
any_char = st.characters(exclude_categories=())
hostile_text = st.one_of(
    st.text(any_char, max_size=12),
    st.sampled_from(["\ud800", "\udfff", "a\ud83db", "\x00", "a\x00b", "\\u0000", "\\\x00"]),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**5000), max_value=10**5000),
    st.floats(),  # NaN and infinities included
    st.sampled_from([1e16, 1.5e300, -0.0, 5e-324, 1e308, 10**16 + 1, 2**63]),
    hostile_text,
)
python_params = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(hostile_text, children, max_size=3),
        st.dictionaries(st.one_of(st.integers(), st.floats(), st.none()), children, max_size=2),
    ),
    max_leaves=10,
)

# -- strategies: raw request bodies ------------------------------------------------------------

json_string = st.one_of(
    st.builds(
        lambda s, ascii_: json.dumps(s, ensure_ascii=ascii_), st.text(max_size=10), st.booleans()
    ),
    st.sampled_from(
        [
            '"\\ud800"',
            '"\\udfff"',
            '"x\\udc00y"',
            '"\\ud800\\ud800"',
            '"\\ud83d\\ude00"',
            '"\\u0000"',
            '"a\\u0000b"',
            '"\\\\u0000"',
            '"\\u00e9"',
            '"é"',
        ]
    ),
)
json_number = st.one_of(
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(
        [
            "NaN",
            "Infinity",
            "-Infinity",
            "1e16",
            "1E16",
            "1.0e16",
            "123456789012345678",
            "1e400",
            "-1e400",
            "1e-400",
            "5e-324",
            "-0",
            "-0.0",
            "0.10",
            "1" * 5000,
        ]
    ),
)
json_key = st.one_of(st.sampled_from(['"a"', '"b"', '""', '"\\u0000"', '"\\ud800"']), json_string)
json_text = st.recursive(
    st.one_of(json_string, json_number, st.sampled_from(["true", "false", "null"])),
    lambda children: st.one_of(
        st.lists(children, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
        # Keys drawn from a small set, so duplicate keys are common.
        st.lists(st.tuples(json_key, children), max_size=3).map(
            lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}"
        ),
    ),
    max_leaves=8,
)
padding = st.sampled_from(["", " ", "\n", "\t", "\ufeff"])
json_body = st.builds(lambda a, j, b: (a + j + b).encode(), padding, json_text, padding)
bodies = st.one_of(
    json_body,
    st.binary(max_size=24),
    st.text(max_size=24).map(str.encode),
    # hypothesis raises the recursion limit while it runs a test: go far beyond it too.
    st.sampled_from(
        [deep_json(DEEP), deep_json(100_000), Blob(b'{"blob": "' + b"x" * 70_000 + b'"}')]
    ),
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/problem+json",
        "text/plain",
        "text/plain; charset=latin-1",
        "application/octet-stream",
        "application/x-www-form-urlencoded",
        "",
    ]
)

# Hostile bodies every body property starts from (JSON unless said otherwise).
HOSTILE_BODIES: list[tuple[bytes, str]] = [
    (b'{"name": "\\ud800"}', "application/json"),
    (b'{"name": "\\udfff", "quantity": 1}', "application/json"),
    (b'{"name": "\\u0000"}', "application/json"),
    (b'{"name": "a\\u0000b", "\\u0000": 1}', "application/json"),
    (deep_json(DEEP), "application/json"),
    (deep_json(100_000), "application/json"),
    (b'{"name": NaN}', "application/json"),
    (b'{"name": "x", "quantity": Infinity}', "application/json"),
    (b'{"name": "x", "quantity": -Infinity}', "application/json"),
    (b'{"name": "x", "quantity": 1e16}', "application/json"),
    (b'{"name": "x", "quantity": 1e400}', "application/json"),
    (b'{"name": "x", "quantity": -0.0}', "application/json"),
    (b'{"name": "a", "name": "b"}', "application/json"),
    (b'{"name": "\xff\xfe"}', "application/json"),
    (b"\xff\xfe\x00", "application/json"),
    (b"\xed\xa0\x80", "text/plain"),
    (b"nul\x00inside", "text/plain"),
    (Blob(b'{"name": "' + b"x" * 70_000 + b'"}'), "application/json"),
    (Blob(b'{"name": "' + b"x" * 2_000_000 + b'"}'), "application/json"),
    (b"1" * 5000, "application/json"),
]


# -- strategies: headers and paths -------------------------------------------------------------

printable = string.ascii_letters + string.digits + string.punctuation + " "
bare_key = st.text(printable, min_size=0, max_size=16)


def sf_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


key_value = st.one_of(
    bare_key.map(str.encode),
    bare_key.map(sf_string).map(str.encode),
    st.tuples(
        st.one_of(bare_key, bare_key.map(sf_string)),
        st.sampled_from([";a=1", '; a="x"', ";a", ";", ";a=?1", " ;a=1"]),
    ).map(lambda kp: (kp[0] + kp[1]).encode()),
    # Odd bytes, but never a line break, which no HTTP parser lets through.
    st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
    st.sampled_from([b"k" * 256, b'"' + b"k" * 255 + b'"', b"cl\xc3\xa9", b"\x00", b'""', b'"']),
)
key_headers = st.lists(key_value, max_size=3)

HOSTILE_KEY_HEADERS: list[list[bytes]] = [
    [],
    [b"k"],
    [b"k", b"k"],
    [b'"k"'],
    [b'"k";p=1'],
    [b"k;p=1"],
    [b'"a\\"b"'],
    [b'"a,b"'],
    [b"a,b"],
    [b"k\x00"],
    [b"\xff"],
    [b"cl\xc3\xa9"],
    [b" k "],
    [b'""'],
]

path_part = st.one_of(
    st.text(string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@", max_size=8),
    st.sampled_from(
        [
            "%00",
            "a%00b",
            "%ED%A0%80",
            "%ff",
            "%C0%80",
            "%2e%2e",
            "%2F",
            "%25",
            "%u0000",
            "\u00e9",
            "\U0001f600",
            "%7F",
        ]
    ),
)
tails = st.lists(path_part, min_size=1, max_size=3).map("/".join)
queries = st.one_of(st.just(""), st.lists(path_part, max_size=2).map("&".join))

HOSTILE_TARGETS = [
    ("%00", ""),
    ("x", "q=%00"),
    ("%ED%A0%80", ""),
    ("x", "q=%ED%A0%80"),
    ("%ff", "q=%ff"),
    ("x%00y", "a=%00&b"),
]


# -- answers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class ServerErrors(logging.Handler):
    """Keeps the exceptions the services log, to raise a 5xx's assertion from its cause."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.caught: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.caught.append(record.exc_info[1])


class Service:
    """One framework's app, and how to send it a request."""

    def __init__(self, name: str, send: Any) -> None:
        self.name = name
        self._send = send

    def post(
        self,
        target: str,
        *,
        tenant: str | None,
        keys: Sequence[bytes] = (),
        body: bytes = b"",
        content_type: str = "application/json",
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> Answer:
        headers: list[tuple[bytes, bytes]] = [(b"Idempotency-Key", k) for k in keys]
        headers.extend(extra)
        if tenant is not None:
            headers.append((TENANT.encode(), tenant.encode("latin-1")))
        if content_type:
            headers.append((b"Content-Type", content_type.encode()))
        answer: Answer = self._send(target, headers, bytes(body))
        return answer


def _fastapi_sender(client: TestClient) -> Any:
    def send(target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Answer:
        response = client.request("POST", target, content=body, headers=headers)
        return Answer(response.status_code, list(response.headers.multi_items()), response.content)

    return send


def _flask_sender(client: Any) -> Any:
    def send(target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Answer:
        # WSGI headers are latin-1 text: each byte one character, as a server would pass them.
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        response = client.open(target, method="POST", data=body, headers=sent)
        return Answer(response.status_code, list(response.headers.items()), response.get_data())

    return send


@pytest.fixture(scope="module")
def hostile_engine(db: sa.Engine) -> rp.Engine:
    RUNS.bind(db)
    engine = rp.Engine(db)
    engine.register(echo_operation())
    return engine


@pytest.fixture(scope="module")
def server_errors() -> Iterator[ServerErrors]:
    handler = ServerErrors()
    loggers = [logging.getLogger(n) for n in ("recoverypoint", "hostile_tests", "flask.app")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def services(
    hostile_engine: rp.Engine, server_errors: ServerErrors
) -> Iterator[dict[str, Service]]:
    op = hostile_engine.operation("hostile_echo", 1)
    flask_client = flask_app(hostile_engine, op).test_client()
    # raise_server_exceptions: an exception the integration let escape reaches the test as
    # itself (a 500 for a real client), so hypothesis reports each kind on its own.
    with TestClient(fastapi_app(hostile_engine, op), raise_server_exceptions=True) as client:
        yield {
            "fastapi": Service("fastapi", _fastapi_sender(client)),
            "flask": Service("flask", _flask_sender(flask_client)),
        }


def keys_in(db: sa.Engine, scope: str) -> int:
    with db.connect() as conn:
        return int(
            conn.scalar(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE scope = :s"), {"s": scope}
            )
        )


def keys_under(db: sa.Engine, prefix: str) -> int:
    """Key records whose scope starts with ``prefix`` (for scopes the driver cannot send)."""
    with db.connect() as conn:
        return int(
            conn.scalar(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE starts_with(scope, :p)"),
                {"p": prefix},
            )
        )


# -- the properties, as assertions ------------------------------------------------------------


def assert_no_5xx(answer: Answer, errors: ServerErrors) -> None:
    if answer.status >= 500:
        cause = errors.caught[-1] if errors.caught else None
        raise AssertionError(
            f"the server answered {answer.status}: {answer.text[:300]!r}"
            + (f" (the server logged {type(cause).__name__}: {cause})" if cause else "")
        ) from cause


def assert_no_internals(answer: Answer, sent: str) -> None:
    """Nothing in the answer looks like the server's insides, unless the client sent it."""
    shown = answer.text + "\n" + "\n".join(f"{k}: {v}" for k, v in answer.headers)
    for pattern in INTERNALS:
        found = pattern.search(shown)
        if found and not pattern.search(sent):
            raise AssertionError(f"the answer shows {found.group(0)!r}: {shown[:500]!r}")


def assert_same_answer(first: Answer, again: Answer) -> None:
    assert again.status == first.status, (first.status, again.status, again.text[:300])
    if 200 <= first.status < 300:
        assert first.header("Idempotent-Replayed") is None
        assert again.header("Idempotent-Replayed") == "true"
    assert again.body == first.body, f"first {first.body[:300]!r}, again {again.body[:300]!r}"


def assert_exchange(
    db: sa.Engine,
    errors: ServerErrors,
    tenant: str,
    first: Answer,
    again: Answer,
    sent: str,
) -> None:
    """The five properties for one request sent twice in a fresh scope."""
    for answer in (first, again):
        assert_no_5xx(answer, errors)
        assert_no_internals(answer, sent)
    stored = keys_in(db, tenant)
    if 400 <= first.status < 500:
        assert stored == 0, f"the refused request ({first.status}) left {stored} key record(s)"
        assert RUNS[tenant] == 0, f"the refused request ({first.status}) did its work"
    else:
        assert stored == 1
        assert RUNS[tenant] == 1, f"the work ran {RUNS[tenant]} times"
    assert_same_answer(first, again)


def describe(*parts: Any) -> str:
    """What the client sent, as text, to tell its own words from the server's."""
    return "\n".join(p.decode("latin-1") if isinstance(p, bytes) else str(p) for p in parts)


# -- Engine.run --------------------------------------------------------------------------------


def run_engine(
    engine: rp.Engine, *, key: Any, scope: str, params: Any, request: rp.Request
) -> rp.Outcome | rp.IdempotencyError:
    """``Engine.run`` in ``scope``'s name (the phases read it); an IdempotencyError is
    returned, and must be a 4xx; anything else escapes and fails the test as itself."""
    token = CURRENT.set(scope)
    try:
        return engine.run(
            engine.operation("hostile_echo", 1),
            key=key,
            scope=scope,
            params=params,
            request=request,
        )
    except rp.IdempotencyError as exc:
        assert exc.http_status < 500, f"{type(exc).__name__} ({exc.http_status}) for bad input"
        return exc
    finally:
        CURRENT.reset(token)


def rendered(outcome: rp.Outcome) -> tuple[int, bytes, dict[str, str]]:
    """An outcome as a client would get it: status, body bytes, headers."""
    body = json.dumps(outcome.body, separators=(",", ":"), ensure_ascii=False).encode()
    return outcome.status, body, outcome.headers


def assert_engine_twice(
    engine: rp.Engine, db: sa.Engine, *, key: Any, params: Any, request: rp.Request
) -> None:
    scope = uuid.uuid4().hex
    first = run_engine(engine, key=key, scope=scope, params=params, request=request)
    again = run_engine(engine, key=key, scope=scope, params=params, request=request)
    if isinstance(first, rp.IdempotencyError):
        assert keys_in(db, scope) == 0, f"{type(first).__name__} left a key record"
        assert RUNS[scope] == 0, f"{type(first).__name__}, yet a phase ran"
        assert type(again) is type(first) and again.http_status == first.http_status
        return
    assert not first.replayed and first.status == 201
    assert keys_in(db, scope) == 1
    assert RUNS[scope] == 1
    assert isinstance(again, rp.Outcome), f"the repeat raised {again!r}"
    assert again.replayed
    assert rendered(again) == rendered(first)
    assert RUNS[scope] == 1


@settings(HOSTILE, max_examples=100)
@given(params=python_params)
@example(params={"name": "\ud800"})
@example(params={"name": "\udfff"})
@example(params={"\ud800": 1})
@example(params={"name": "\x00"})
@example(params={"name": "\\u0000"})
@example(params={"x": float("nan")})
@example(params={"x": float("-inf")})
@example(params={"x": 1e16})
@example(params={"x": -0.0})
@example(params={"x": 10**5000})
@example(params={1: "a", "1": "b"})
@example(params=Deep(DEEP))
@example(params=Deep(100_000))
@example(params=Huge(70_000))
@example(params=Huge(40_000, "\u00e9"))
@pytest.mark.slow
def test_engine_run_refuses_bad_params_with_a_4xx_and_replays_good_ones(
    hostile_engine: rp.Engine, db: sa.Engine, params: Any
) -> None:
    assert_engine_twice(
        hostile_engine,
        db,
        key="k",
        params=built(params),
        request=rp.Request("POST", "/orders"),
    )


@settings(HOSTILE, max_examples=80)
@given(key=st.one_of(st.text(any_char, max_size=300), st.text(printable, max_size=300)))
@example(key="")
@example(key="k" * 255)
@example(key="k" * 256)
@example(key="\ud800")
@example(key="k\x00")
@example(key="\x7f")
@example(key="clé")
@example(key=" ")
@pytest.mark.slow
def test_engine_run_refuses_bad_keys_with_a_400(
    hostile_engine: rp.Engine, db: sa.Engine, key: str
) -> None:
    assert_engine_twice(
        hostile_engine, db, key=key, params={"n": 1}, request=rp.Request("POST", "/orders")
    )


@settings(HOSTILE, max_examples=80)
@given(
    method=st.one_of(
        st.sampled_from(["POST", "post", "PUT", "ß", ""]), st.text(any_char, max_size=6)
    ),
    path=st.one_of(st.text(any_char, max_size=30), st.text(printable, max_size=30)),
)
@example(method="POST", path="/orders/\x00")
@example(method="POST", path="/orders/\ud800")
@example(method="PO\x00ST", path="/orders")
@example(method="\udfff", path="/orders")
@example(method="POST", path="/" + "x" * 100_000)
def test_engine_run_refuses_bad_methods_and_paths_with_a_4xx(
    hostile_engine: rp.Engine, db: sa.Engine, method: str, path: str
) -> None:
    assert_engine_twice(
        hostile_engine, db, key="k", params={"n": 1}, request=rp.Request(method, path)
    )


@settings(HOSTILE, max_examples=50)
@given(suffix=st.text(any_char, max_size=40))
@example(suffix="\ud800")
@example(suffix="\x00")
@example(suffix="x" * 300)
@example(suffix="\u00e9\U0001f600")
@pytest.mark.slow
def test_engine_run_takes_any_valid_scope_and_refuses_others_with_value_error(
    hostile_engine: rp.Engine, db: sa.Engine, suffix: str
) -> None:
    """Scopes come from the application: an invalid one is a ValueError (documented), never
    a driver or encoding error, and leaves nothing behind; every other one owns its keys."""
    prefix = uuid.uuid4().hex
    scope = prefix + suffix
    request = rp.Request("POST", "/orders")
    try:
        first = run_engine(hostile_engine, key="k", scope=scope, params={}, request=request)
    except ValueError as exc:
        if isinstance(exc, UnicodeError):
            raise  # a driver's encoding error, not the documented refusal
        assert "scope" in str(exc)
        assert keys_under(db, prefix) == 0
        assert RUNS[scope] == 0
        return
    assert isinstance(first, rp.Outcome) and first.status == 201
    assert first.body["tenant"] == scope
    again = run_engine(hostile_engine, key="k", scope=scope, params={}, request=request)
    assert isinstance(again, rp.Outcome) and again.replayed
    assert rendered(again) == rendered(first)
    assert keys_under(db, prefix) == 1
    assert RUNS[scope] == 1


@settings(HOSTILE, max_examples=40)
@given(
    key=st.text(printable, min_size=1, max_size=40),
    other=st.one_of(
        # Valid scopes only: which scopes are refused is the test above's business.
        st.text(
            st.characters(exclude_characters="\x00", exclude_categories=("Cs",)),
            min_size=1,
            max_size=10,
        ),
        st.sampled_from([" ", "A", "\u00e9", "\U0001f600"]),
    ),
    params=python_params,
)
@example(key="k", other=" ", params={"a": 1})
@example(key="k", other="K", params={"a": 1})
def test_engine_run_never_answers_across_scopes(
    hostile_engine: rp.Engine, db: sa.Engine, key: str, other: str, params: Any
) -> None:
    mine = uuid.uuid4().hex
    theirs = mine + other
    request = rp.Request("POST", "/orders")
    a1 = run_engine(hostile_engine, key=key, scope=mine, params=params, request=request)
    b1 = run_engine(hostile_engine, key=key, scope=theirs, params=params, request=request)
    a2 = run_engine(hostile_engine, key=key, scope=mine, params=params, request=request)
    b2 = run_engine(hostile_engine, key=key, scope=theirs, params=params, request=request)
    if isinstance(a1, rp.IdempotencyError):  # params refused: in both scopes alike
        assert all(type(x) is type(a1) for x in (b1, a2, b2))
        assert RUNS[mine] == RUNS[theirs] == 0
        assert keys_under(db, mine) == 0
        return
    for first, again, scope in ((a1, a2, mine), (b1, b2, theirs)):
        assert isinstance(first, rp.Outcome) and isinstance(again, rp.Outcome)
        assert not first.replayed and again.replayed
        assert first.body["tenant"] == scope and again.body["tenant"] == scope
        assert rendered(again) == rendered(first)
        assert RUNS[scope] == 1
    assert keys_under(db, mine) == 2


# -- HTTP: bodies and content types ---------------------------------------------------------------

# (framework, route): every phased route and single-step endpoint of hostile_apps.
ROUTES = [
    ("fastapi", "/phased/x"),
    ("fastapi", "/phased-async/x"),
    ("fastapi", "/single/echo"),
    ("fastapi", "/single/json"),
    ("fastapi", "/single/typed"),
    ("flask", "/phased/x"),
    ("flask", "/single/echo"),
    ("flask", "/single/json"),
]
ROUTE_IDS = [f"{framework}{route}" for framework, route in ROUTES]


def with_examples(cases: list[tuple[Any, ...]], names: Sequence[str]) -> Any:
    """Decorate a hypothesis test with an @example per case."""

    def decorate(test: Any) -> Any:
        for case in reversed(cases):
            test = example(**dict(zip(names, case, strict=True)))(test)
        return test

    return decorate


@pytest.mark.parametrize(("framework", "route"), ROUTES, ids=ROUTE_IDS)
@settings(HOSTILE, max_examples=40)
@given(body=bodies, content_type=content_types)
@with_examples(HOSTILE_BODIES, ("body", "content_type"))
@pytest.mark.slow
def test_hostile_bodies_get_a_4xx_or_one_run_and_its_replay(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    body: bytes,
    content_type: str,
) -> None:
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    send = {"tenant": tenant, "keys": [key], "body": body, "content_type": content_type}
    first = service.post(route, **send)
    again = service.post(route, **send)
    assert_exchange(db, server_errors, tenant, first, again, describe(body, content_type))


# -- HTTP: the Idempotency-Key header ------------------------------------------------------------


@pytest.mark.parametrize(("framework", "route"), ROUTES, ids=ROUTE_IDS)
@settings(HOSTILE, max_examples=30)
@given(keys=key_headers)
@with_examples([(k,) for k in HOSTILE_KEY_HEADERS], ("keys",))
@pytest.mark.slow
def test_hostile_key_headers_get_a_400_or_one_run_and_its_replay(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    keys: list[bytes],
) -> None:
    service = services[framework]
    tenant = uuid.uuid4().hex
    server_errors.caught.clear()
    body = b'{"name": "widget"}'
    first = service.post(route, tenant=tenant, keys=keys, body=body)
    again = service.post(route, tenant=tenant, keys=keys, body=body)
    assert_exchange(db, server_errors, tenant, first, again, describe(*keys))
    if first.status == 400:
        assert first.header("Content-Type") == PROBLEM


def test_a_quoted_key_with_parameters_is_refused_or_is_the_key(
    services: dict[str, Service], server_errors: ServerErrors, db: sa.Engine
) -> None:
    """An sf-string item may carry parameters (RFC 8941 §3.1.2); if the server takes
    ``"k";p=1`` at all, it must be the key ``k``, not a key of its own."""
    for name, service in services.items():
        tenant = uuid.uuid4().hex
        bare = service.post("/single/json", tenant=tenant, keys=[b"k"], body=b"{}")
        with_params = service.post("/single/json", tenant=tenant, keys=[b'"k";p=1'], body=b"{}")
        assert_no_5xx(with_params, server_errors)
        assert bare.status == 201, name
        if with_params.status < 300:
            assert with_params.header("Idempotent-Replayed") == "true", name
            assert RUNS[tenant] == 1, name
        else:
            assert with_params.status == 400, name


# -- HTTP: paths and query strings ------------------------------------------------------------


PATH_ROUTES = [("fastapi", "/phased"), ("fastapi", "/phased-async"), ("flask", "/phased")]


@pytest.mark.parametrize(
    ("framework", "route"), PATH_ROUTES, ids=[f"{f}{r}" for f, r in PATH_ROUTES]
)
@settings(HOSTILE, max_examples=30)
@given(tail=tails, query=queries)
@with_examples(HOSTILE_TARGETS, ("tail", "query"))
@pytest.mark.slow
def test_hostile_paths_get_a_4xx_or_one_run_and_its_replay(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    tail: str,
    query: str,
) -> None:
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    target = f"{route}/p/{tail}" + (f"?{query}" if query else "")
    send = {"tenant": tenant, "keys": [key], "body": b'{"name": "widget"}'}
    first = service.post(target, **send)
    again = service.post(target, **send)
    assert first.status != 404, target  # the route takes any tail
    assert_exchange(db, server_errors, tenant, first, again, describe(target))


SINGLE_QUERY_ROUTES = [("fastapi", "/single/json"), ("flask", "/single/json")]


@pytest.mark.parametrize(
    ("framework", "route"), SINGLE_QUERY_ROUTES, ids=[f"{f}{r}" for f, r in SINGLE_QUERY_ROUTES]
)
@settings(HOSTILE, max_examples=20)
@given(query=queries.filter(bool))
@example(query="q=%00")
@example(query="q=%ED%A0%80")
@example(query="%ff=%ff")
@pytest.mark.slow
def test_hostile_queries_on_single_step_endpoints(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    query: str,
) -> None:
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    send = {"tenant": tenant, "keys": [key], "body": b"{}"}
    first = service.post(f"{route}?{query}", **send)
    again = service.post(f"{route}?{query}", **send)
    assert_exchange(db, server_errors, tenant, first, again, describe(query))


# -- HTTP: what tells two requests apart ------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "route"), PATH_ROUTES, ids=[f"{f}{r}" for f, r in PATH_ROUTES]
)
@settings(HOSTILE, max_examples=10)
@given(
    tail=st.text(string.ascii_letters + string.digits, min_size=1, max_size=8),
    query=st.text(string.ascii_letters + string.digits + "=&", min_size=1, max_size=8),
)
@example(tail="a", query="b")
def test_a_question_mark_in_the_path_is_not_a_query(
    services: dict[str, Service],
    server_errors: ServerErrors,
    framework: str,
    route: str,
    tail: str,
    query: str,
) -> None:
    """``/p/a%3Fb`` (a path ending ``a?b``) and ``/p/a?b`` (path ``a``, query ``b``) are two
    request targets; the same key sent to both must not replay one's answer for the other."""
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    send = {"tenant": tenant, "keys": [key], "body": b'{"name": "widget"}'}
    first = service.post(f"{route}/p/{tail}%3F{query}", **send)
    other = service.post(f"{route}/p/{tail}?{query}", **send)
    assert_no_5xx(first, server_errors)
    assert_no_5xx(other, server_errors)
    assert first.status == 201, first.text
    assert other.header("Idempotent-Replayed") is None, (
        f"the target {route}/p/{tail}?{query} got the replay of {route}/p/{tail}%3F{query}"
    )
    assert other.status == 422, other.text
    assert RUNS[tenant] == 1


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise _DuplicateKey
    return dict(pairs)


def json_meaning(body: bytes) -> tuple[str, str | None]:
    """``("json", canonical text)`` for a UTF-8 JSON document without duplicate keys;
    ``("duplicate", None)`` for JSON with duplicate keys; ``("other", None)`` else. A leading
    byte order mark is ignored, as RFC 8259 allows and both frameworks' JSON parsing does."""
    try:
        value = json.loads(body.decode("utf-8-sig"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey:
        return "duplicate", None
    except (ValueError, RecursionError):
        return "other", None
    return "json", json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


simple_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(printable, max_size=6)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.sampled_from("abc"), children)
    ),
    max_leaves=5,
).map(lambda v: json.dumps(v).encode())
first_bodies = st.one_of(simple_json, st.text(printable, min_size=1, max_size=12).map(str.encode))


def _as_json_string(body: bytes) -> bytes:
    return json.dumps(body.decode("utf-8", "replace")).encode()


def _json_string_content(body: bytes) -> bytes:
    kind, _ = json_meaning(body)
    value = json.loads(body) if kind == "json" else None
    return value.encode() if isinstance(value, str) else body + b" "


def _with_duplicate(body: bytes) -> bytes:
    return b'{"a": 0, "a": ' + body + b"}"


def _utf16(body: bytes) -> bytes:
    return body.decode("utf-8", "replace").encode("utf-16")


variations = st.sampled_from([_as_json_string, _json_string_content, _with_duplicate, _utf16])


@pytest.mark.parametrize(
    ("framework", "route"), [("fastapi", "/single/echo"), ("flask", "/single/echo")]
)
@settings(HOSTILE, max_examples=30)
@given(body=first_bodies, vary=variations, other=st.one_of(st.none(), bodies))
@example(body=b"abc", vary=_as_json_string, other=None)
@example(body=b'"abc"', vary=_json_string_content, other=None)
@example(body=b'{"a": 0, "a": 1}', vary=_as_json_string, other=b'{"a": 1}')
@example(body=b"{}", vary=_utf16, other=None)
@pytest.mark.slow
def test_a_different_payload_with_the_same_key_is_never_replayed(
    services: dict[str, Service],
    server_errors: ServerErrors,
    framework: str,
    route: str,
    body: bytes,
    vary: Any,
    other: bytes | None,
) -> None:
    """A single-step endpoint's fingerprint covers its body: a second body that means
    something else (text ``abc`` and the JSON string ``"abc"``; duplicate keys, which JSON
    parsers read differently; another encoding) gets a 422 with the same key, not the
    first body's answer. Bodies that are the same JSON may replay."""
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    second_body = vary(body) if other is None else other
    first = service.post(route, tenant=tenant, keys=[key], body=body)
    second = service.post(route, tenant=tenant, keys=[key], body=second_body)
    assert_no_5xx(first, server_errors)
    assert_no_5xx(second, server_errors)
    if first.status != 201 or second_body == body:
        return  # the first body was refused: the second is a request of its own
    meaning, other_meaning = json_meaning(body), json_meaning(second_body)
    replayed = second.header("Idempotent-Replayed") == "true"
    if meaning[0] == "json" and meaning == other_meaning:
        return  # the same JSON, written otherwise: a replay or a 422 may both do
    if "duplicate" in (meaning[0], other_meaning[0]):
        assert not replayed, f"{second_body!r} (duplicate keys) got the answer to {body!r}"
    elif b"\x00" in second_body[:2] or second_body[:2] in (b"\xff\xfe", b"\xfe\xff"):
        assert not replayed, f"{second_body!r} (UTF-16) got the answer to {body!r}"
    else:
        assert not replayed, f"{second_body!r} got the answer to {body!r}"
    assert 400 <= second.status < 500
    assert RUNS[tenant] == 1


# -- HTTP: a client header the endpoint echoes ----------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "route"), [("fastapi", "/single/echo"), ("flask", "/single/echo")]
)
@settings(HOSTILE, max_examples=20)
# ASCII: starlette's TestClient cannot hand other bytes of a response header to httpx.
@given(
    request_id=st.text(
        st.characters(max_codepoint=0x7F, exclude_characters="\r\n"), max_size=12
    ).map(str.encode)
)
@example(request_id=b"\x00")
@example(request_id=b"req-\x00-1")
@example(request_id=b"\x01\x7f")
def test_an_answer_echoing_a_client_header_is_kept_and_replayed(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    request_id: bytes,
) -> None:
    """Endpoints echo request ids; whatever bytes the client put there, the answer is the
    endpoint's, kept once and replayed, never a 500 after the work was done."""
    service = services[framework]
    tenant, key = uuid.uuid4().hex, uuid.uuid4().hex.encode()
    server_errors.caught.clear()
    send = {
        "tenant": tenant,
        "keys": [key],
        "body": b'{"name": "widget"}',
        "extra": [(REQUEST_ID.encode(), request_id)],
    }
    first = service.post(route, **send)
    again = service.post(route, **send)
    assert_exchange(db, server_errors, tenant, first, again, describe(request_id))


# -- HTTP: scopes ------------------------------------------------------------------------------

tenant_suffix = st.one_of(
    st.text(string.ascii_letters + string.digits + string.punctuation, min_size=1, max_size=8),
    st.sampled_from(["A", " x", "\t1", "\\", '"']),
)


@pytest.mark.parametrize(("framework", "route"), ROUTES, ids=ROUTE_IDS)
@settings(HOSTILE, max_examples=12)
@given(key=st.text(printable.strip(), min_size=1, max_size=20), suffix=tenant_suffix)
@example(key="shared", suffix="A")
def test_the_same_key_in_two_scopes_is_two_requests(
    services: dict[str, Service],
    server_errors: ServerErrors,
    db: sa.Engine,
    framework: str,
    route: str,
    key: str,
    suffix: str,
) -> None:
    service = services[framework]
    mine = uuid.uuid4().hex
    theirs = mine + suffix
    server_errors.caught.clear()
    body = b'{"name": "widget"}'
    answers: dict[str, list[Answer]] = {mine: [], theirs: []}
    for tenant in (mine, theirs, mine, theirs):
        answers[tenant].append(
            service.post(route, tenant=tenant, keys=[sf_string(key).encode()], body=body)
        )
    for tenant, (first, again) in answers.items():
        for answer in (first, again):
            assert_no_5xx(answer, server_errors)
        assert first.status == 201, first.text
        assert first.header("Idempotent-Replayed") is None, "one scope got another's replay"
        assert RUNS[tenant] == 1, f"the work ran {RUNS[tenant]} times for {tenant!r}"
        assert keys_in(db, tenant) == 1
        if "json" in (first.header("Content-Type") or "") and not route.endswith("/echo"):
            assert json.loads(first.body)["tenant"] == tenant
        assert_same_answer(first, again)


# -- HTTP: an endpoint that refuses with the framework's own error --------------------------------


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
def test_a_single_step_endpoint_refusing_with_an_http_error_answers_it(
    services: dict[str, Service], server_errors: ServerErrors, db: sa.Engine, framework: str
) -> None:
    """``HTTPException(409)`` / ``abort(409)`` in a single-step endpoint is the endpoint's
    answer, first and on every retry: never a 500."""
    service = services[framework]
    tenant = uuid.uuid4().hex
    server_errors.caught.clear()
    first = service.post("/single/refuse", tenant=tenant, keys=[b"k"], body=b"{}")
    again = service.post("/single/refuse", tenant=tenant, keys=[b"k"], body=b"{}")
    for answer in (first, again):
        assert_no_5xx(answer, server_errors)
        assert_no_internals(answer, "")
        assert answer.status == 409
    assert again.body == first.body
