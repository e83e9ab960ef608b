"""The HTTP contract every integration shares, free of I/O and of any web framework.

- the header names;
- how the ``Idempotency-Key`` header is read;
- how an exception becomes an ``application/problem+json`` answer (RFC 9457) with the status
  codes of the IETF draft (``draft-ietf-httpapi-idempotency-key-header``);
- how an :class:`~recoverypoint.Outcome` becomes an answer, a replay marked as one.

An answer is a :class:`Reply`: status, headers and body bytes, which each framework sends
as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from http import HTTPStatus
from typing import Any

from ..errors import (
    ConfigurationError,
    IdempotencyError,
    InvalidKey,
    KeyInUse,
    PhaseLeftScope,
    TransactionEnded,
)
from ..keys import validate_key
from ..operation import PROBLEM_TYPE_PREFIX, Outcome
from ._sfv import ParseError, Token, parse_item

IDEMPOTENCY_KEY = "Idempotency-Key"
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
IDEMPOTENT_UNPROTECTED = "Idempotent-Unprotected"
RETRY_AFTER = "Retry-After"
CONTENT_TYPE = "Content-Type"
PROBLEM_JSON = "application/problem+json"
JSON = "application/json"


# What a 500 tells the client: enough to act on, nothing about the server's insides.
UNEXPECTED_DETAIL = (
    "The server failed while handling this request. Retry it with the same Idempotency-Key: "
    "the work already done is kept and is not repeated."
)

# What a 500 for a configuration mistake tells the client: not to retry in a loop.
CONFIGURATION_DETAIL = (
    "The service is not set up to handle this request, and retrying it will not help until "
    "its operators fix that; they have been told."
)

# What a 500 for phase code that ended its own transaction tells the client: the same, of
# the service's code.
SERVICE_CODE_DETAIL = (
    "This request failed on a fault in the service's code, and retrying it will not help "
    "until its operators fix that; they have been told."
)

# Statuses that carry no body (RFC 9110 §6.4.1).
_NO_BODY = frozenset({204, 205, 304})

_CAMEL_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")


@dataclass(frozen=True)
class Reply:
    """An HTTP answer, ready to send."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def header_name(name: object, what: str) -> str:
    """``name`` if it can name an HTTP header field (a token, RFC 9110 §5.1), else
    :class:`ValueError` naming ``what`` it was meant for."""
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise ValueError(
            f"{what} must be an HTTP header name: 1 to {_MAX_NAME} letters, digits or "
            f"!#$%&'*+-.^_`|~ (RFC 9110), got {name!r:.80}"
        )
    if name.lower() in _NOT_OURS:
        raise ValueError(f"{what} may not be {name!r}: the server or the framework owns it")
    return name


_MAX_NAME = 64
_TOKEN = re.compile(rf"[!#$%&'*+.^_`|~0-9A-Za-z-]{{1,{_MAX_NAME}}}")
# Headers whose meaning is fixed elsewhere: framing, the body's type, cookies, Retry-After.
_NOT_OURS = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "host",
        "content-type",
        "set-cookie",
        "cookie",
        "retry-after",
    }
)


def read_key(values: Sequence[str], header: str = IDEMPOTENCY_KEY) -> str:
    """The idempotency key from the lines of the ``Idempotency-Key`` header (or of
    ``header``, as the integration is configured).

    The IETF draft makes the header an Item Structured Field whose value is a String
    (RFC 8941): ``"8e03978e-40d5"``, parameters allowed (``"8e03978e-40d5";p=1``) and
    ignored. The lines are joined with ``", "`` and parsed as one Item, as RFC 8941 §4.2
    says, so two keys (two lines, or ``"a", "b"``) are refused.

    Stripe's clients, this library's own among them, send the key bare: ``8e03978e-40d5``.
    A value that is not a String is accepted as a bare key, its text being the key, when:

    - it has no space, tab, comma, semicolon or double quote (so it cannot be two keys, a
      quoted key gone wrong, or a key with parameters); and
    - it is not an Integer, Decimal, Boolean or Byte Sequence Item (``12``, ``1.5``,
      ``?1``, ``:YWJj:``), whose value is something other than their text. It may be a
      Token (``key-1``, ``a1b2c3d4-…``: a UUID that starts with a letter is one), whose
      value is its text, or no Item at all (``8e03978e-…``: a UUID that starts with a digit
      is not one; nor is ``1234567890123456``, beyond an Integer's 15 digits).

    Everything else raises :class:`~recoverypoint.InvalidKey` (400), as do a missing header
    and a key :func:`~recoverypoint.keys.validate_key` refuses (empty, over 255
    characters, not printable ASCII).
    """
    text = ", ".join(values)
    if not text.strip(" "):
        raise InvalidKey(
            f"this request needs an {header} header: send a unique key, "
            "for example a UUID4, and the same key when you retry"
        )
    try:
        value, params = parse_item(text)
    except ParseError as exc:
        value, params = Token(_bare_key(text, values, exc, header)), {}
    if isinstance(value, Token) and params:
        raise InvalidKey(f'quote an {header} sent with parameters: "key";param=1')
    if not isinstance(value, str):
        kind = _ITEM_TYPES[type(value)]
        raise InvalidKey(f'the {header} must be a string, such as "8e03978e-40d5", not {kind}')
    return validate_key(str(value))


_ITEM_TYPES = {int: "an integer", Decimal: "a decimal", bool: "a boolean", bytes: "bytes"}
_NOT_BARE = re.compile(r'[ \t,;"]')


def _bare_key(text: str, values: Sequence[str], error: ParseError, header: str) -> str:
    """``text`` as a bare key, or :class:`~recoverypoint.InvalidKey` (see :func:`read_key`)."""
    if len(values) > 1:
        raise InvalidKey(f"send one {header} header, not {len(values)}")
    key = text.strip(" ")
    if _NOT_BARE.search(key):
        raise InvalidKey(
            f"the {header} is not a valid string ({error}); send one key, in double "
            'quotes if it has spaces, commas or semicolons: "key"'
        )
    return key


def outcome_reply(outcome: Outcome, replayed_header: str = IDEMPOTENT_REPLAYED) -> Reply:
    """The stored (or just produced) response; a replay says so in ``Idempotent-Replayed``
    (or in ``replayed_header``, as the integration is configured)."""
    headers = list(outcome.headers.items())
    if outcome.replayed:
        headers.append((replayed_header, "true"))
    return Reply(outcome.status, *_body(outcome.status, outcome.body, headers))


def _body(
    status: int, body: Any, headers: list[tuple[str, str]]
) -> tuple[list[tuple[str, str]], bytes]:
    content_type = next((v for k, v in headers if k.lower() == "content-type"), None)
    if status < 200 or status in _NO_BODY:
        return [(k, v) for k, v in headers if k.lower() != "content-type"], b""
    if content_type is None:
        return [*headers, (CONTENT_TYPE, JSON)], _json(body)
    if isinstance(body, str) and "json" not in content_type.lower():
        return headers, body.encode()  # a text response, stored as text
    return headers, _json(body)


def problem_reply(exc: BaseException, *, retry_after: int) -> Reply:
    """``application/problem+json`` for an exception raised while serving a request.

    An :class:`~recoverypoint.IdempotencyError` gets its ``http_status``; 409 and 503 add
    ``Retry-After: retry_after`` (a key in use: no more than the rest of its lease). A
    :class:`~recoverypoint.ConfigurationError` is a 500 that says the service is set up
    wrongly and a retry will not help; a :class:`~recoverypoint.TransactionEnded` (phase code
    that ends its own transaction) or :class:`~recoverypoint.PhaseLeftScope` (a Citus phase
    that writes outside its scope) one that says its code is at fault, as no retry mends.
    Anything else, and an ``IdempotencyError`` of status 500, is a 500 whose text tells the
    client to retry with the same key; no server detail is ever sent. 5xx answers use the
    error's default text, not its message, which phase code may have filled with internal
    detail.
    """
    cls = type(exc)
    if isinstance(exc, ConfigurationError):
        # The service's mistake, which no retry mends: said so, without its insides.
        kind = _CAMEL_BOUNDARY.sub("-", cls.__name__).lower()
        return problem(500, kind, "The service is misconfigured", CONFIGURATION_DETAIL)
    if isinstance(exc, (TransactionEnded, PhaseLeftScope)):
        # As deterministic: the phase's code does the same on every attempt.
        kind = _CAMEL_BOUNDARY.sub("-", cls.__name__).lower()
        title = "The service failed to handle this request"
        return problem(500, kind, title, SERVICE_CODE_DETAIL)
    if not isinstance(exc, IdempotencyError) or exc.http_status == 500:
        return problem(
            500, "unexpected-error", "The request failed unexpectedly", UNEXPECTED_DETAIL
        )
    default = _one_line(cls.__doc__ or "")
    headers: list[tuple[str, str]] = []
    if exc.http_status in (409, 503):
        wait = min(exc.retry_after, retry_after) if isinstance(exc, KeyInUse) else retry_after
        headers.append((RETRY_AFTER, str(max(1, wait))))
    return problem(
        exc.http_status,
        _CAMEL_BOUNDARY.sub("-", cls.__name__).lower(),
        re.split(r"[:;.]", default, maxsplit=1)[0],
        _one_line(exc.message) if exc.http_status < 500 else default,
        headers,
    )


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str,
    headers: Sequence[tuple[str, str]] = (),
) -> Reply:
    """A problem+json reply; ``kind`` becomes the last part of the problem's ``type``."""
    body = {
        "type": PROBLEM_TYPE_PREFIX + kind,
        "title": title,
        "status": status,
        "detail": detail,
    }
    return Reply(status, [*headers, (CONTENT_TYPE, PROBLEM_JSON)], _json(body))


def http_problem(status: int, detail: Any, headers: Sequence[tuple[str, str]] = ()) -> Reply:
    """A problem+json reply for an HTTP error the application raised (401 from its auth...)."""
    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return problem(status, f"http-{status}", title, text, headers)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _one_line(text: str) -> str:
    return " ".join(text.split())
