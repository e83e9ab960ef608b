"""Pure functions on keys and params: validation, canonical JSON, fingerprints, derived keys.

Nothing here touches the database, so every rule can be read (and tested) on its own.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final, Literal

from .errors import InvalidKey, InvalidParams, RequestTooLarge

MAX_KEY_LENGTH = 255
MAX_SCOPE_LENGTH = 255
MAX_PATH_LENGTH = 8192
DEFAULT_MAX_PARAMS_BYTES = 64 * 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in params: far beyond any real request,
far below the depth at which Python's recursion limit would stop json."""

# Printable ASCII, as the IETF draft's sf-string allows; rules out NUL, controls and
# look-alike Unicode that would make two keys print the same.
_KEY_PATTERN = re.compile(r"[\x20-\x7e]+")
# An HTTP method is a token (RFC 9110 §9.1); the longest registered one has 17 characters.
_METHOD_PATTERN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}")
# json.dumps writes a NUL as \u0000 (after an even run of backslashes); jsonb refuses it.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a usable idempotency key, else raise :class:`InvalidKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("the idempotency key is missing: send a unique key, for example a UUID4")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"the idempotency key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}"
        )
    if not _KEY_PATTERN.fullmatch(key):
        raise InvalidKey(
            "the idempotency key may hold printable ASCII characters only (no NUL, no controls)"
        )
    return key


def validate_scope(scope: object) -> str:
    """Return ``scope`` if it can own keys; scopes come from the application, not the client."""
    return _stored_name(scope, "scope", MAX_SCOPE_LENGTH, may_be_empty=True)


class _Unscoped(enum.Enum):
    UNSCOPED = "unscoped"


UNSCOPED: Final = _Unscoped.UNSCOPED
"""Passed as ``scope=``, it says on purpose that keys have no owner: every key is in the one
scope shared by all callers (a service with no users, an internal job). An integration
never assumes it: a scope function that returns ``""`` is refused."""

Unscoped = Literal[_Unscoped.UNSCOPED]


def chosen_scope(scope: object, owner: str) -> str:
    """A scope function's (or rule's) result for ``owner``: refused with a
    :class:`ValueError` when empty, which would put the keys of every caller it says
    nothing about in one namespace shared by all."""
    if scope == "":
        raise ValueError(
            f"{owner} returned an empty scope, which would put these keys in one namespace "
            "shared by every caller: return the user's or tenant's id, or pass "
            "scope=UNSCOPED if one shared namespace is what you mean"
        )
    return validate_scope(scope)


def validate_request(method: object, path: object) -> tuple[str, str]:
    """Return the request's method (upper case) and path if they can be stored and
    fingerprinted; raise :class:`InvalidParams` (422) or :class:`RequestTooLarge` (413)."""
    if not isinstance(method, str) or not _METHOD_PATTERN.fullmatch(method):
        raise InvalidParams(f"the request method {method!r:.40} is not an HTTP method")
    if not isinstance(path, str):
        raise InvalidParams(f"the request path must be a str, got {type(path).__name__}")
    if len(path) > MAX_PATH_LENGTH:
        raise RequestTooLarge(
            f"the request path is {len(path)} characters long; the limit is {MAX_PATH_LENGTH}"
        )
    if "\x00" in path or not (path.isascii() or _encodable(path)):
        raise InvalidParams(
            "the request path holds a NUL character or a lone surrogate, "
            "which cannot be stored; fix the URL"
        )
    return method.upper(), path


_NESTED = (dict, list, tuple)


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`InvalidParams` when arrays and objects in ``value`` nest deeper than
    ``limit``. Iterative: a hostile depth must not exhaust the stack that checks it."""
    if not isinstance(value, _NESTED):
        return
    # Only containers go on the stack: a request's params are mostly scalars, and a pair
    # made and taken back for each of them cost as much as the rest of the walk.
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            raise InvalidParams(
                f"the params nest arrays and objects deeper than {limit} levels; "
                "flatten the request"
            )
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, _NESTED):
                pending.append((child, depth + 1))


# Made once: json.dumps with options makes an encoder per call.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
# And its encode() makes json's C encoder anew for every value, which cost a third of
# encoding a phase's state: that one is made once here, as encode() makes it, except that
# it keeps no record of the containers it is inside (shared by every thread, such a record
# would be wrong), so a value that holds itself raises RecursionError, as one nested too
# deeply does. A Python without json's C speedups uses encode() itself.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)
_CANONICAL_CHUNKS: Callable[[Any, int], Sequence[str]] = (
    (lambda value, _: (_CANONICAL.encode(value),))
    if _C_MAKE_ENCODER is None
    else _C_MAKE_ENCODER(
        None, _CANONICAL.default, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )
)


def canonical_json(value: Any) -> str:
    """Serialise ``value`` the same way every time, so equal params hash equal.

    Raises :class:`ValueError` for values JSON cannot carry or PostgreSQL cannot store (NaN,
    infinities, NUL characters, lone surrogates, nesting beyond Python's recursion limit).
    """
    try:
        text = "".join(_CANONICAL_CHUNKS(value, 0))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON-serialisable: {exc}") from exc
    except RecursionError:
        raise ValueError("nested too deeply, or holding itself") from None
    # The substring test first: the pattern, tried at every position, cost as much as the
    # encoding of a small value.
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise ValueError("holding a NUL character, which PostgreSQL cannot store")
    if not text.isascii() and not _encodable(text):
        raise ValueError("holding a lone surrogate, which is not valid Unicode text")
    return text


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode, which a lone surrogate (``"\\ud800"`` in JSON,
    accepted by Python's json) is not: UTF-8 and PostgreSQL refuse it. Callers try
    ``isascii()`` first, which is enough for nearly every text and costs no call."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_size(text: str, limit: int) -> None:
    """Raise :class:`RequestTooLarge` when ``text`` takes more than ``limit`` bytes."""
    size = len(text.encode())
    if size > limit:
        raise RequestTooLarge(f"the params take {size} bytes; the limit is {limit}")


def fingerprint(method: str, path: str, params_json: str) -> str:
    """SHA-256 of the canonical request: a reused key must carry the same one."""
    # One text, encoded and hashed at once: the same bytes as the three parts hashed each
    # behind its NUL, in a third of the calls (a replay computes it too).
    return hashlib.sha256(f"{method.upper()}\x00{path}\x00{params_json}\x00".encode()).hexdigest()


MAX_NAMESPACE_LENGTH = 255


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it can tell one database's derived keys from another's."""
    return _stored_name(namespace, "namespace", MAX_NAMESPACE_LENGTH, may_be_empty=False)


def _stored_name(value: object, what: str, limit: int, *, may_be_empty: bool) -> str:
    """``value`` if it is text PostgreSQL can store (no NUL, no lone surrogate) of at most
    ``limit`` characters; else a :class:`ValueError` naming ``what``."""
    if (
        not isinstance(value, str)
        or not (value or may_be_empty)
        or len(value) > limit
        or "\x00" in value
        or not (value.isascii() or _encodable(value))
    ):
        kind = "a str" if may_be_empty else "a non-empty str"
        raise ValueError(
            f"{what} must be {kind} of at most {limit} characters without NUL or "
            f"lone surrogates, got {value!r:.80}"
        )
    return value


def key_seed(namespace: str, scope: str, operation: str, key: str) -> str:
    """What every key derived for one request shares: a function of what the client sent
    and of the database's namespace, never of the key row. A row lost in a failover to a
    lagging standby is claimed again with the same seed, so a provider that dedupes sees
    the same downstream key and does not charge twice. Hashed: it reveals neither the
    scope nor the client's key."""
    text = "\x00".join(("recoverypoint-seed-1", namespace, scope, operation, key))
    return hashlib.sha256(text.encode()).hexdigest()


def legacy_key_material(key_id: int, created_at: datetime, operation: str = "") -> str:
    """What the keys derived for a record claimed before seeds existed share: its id and
    creation time. Kept so that keys in flight across an upgrade keep handing out the
    downstream keys they already handed out (their row has no seed)."""
    # The instant, not its rendering: the session's TimeZone must not change the key.
    created = created_at.astimezone(timezone.utc).isoformat()
    return f"{operation}\x00{key_id}\x00{created}"


def record_material(
    seed: str | None, key_id: int, created_at: datetime, operation: str, generation: int = 0
) -> str:
    """What the keys derived for one key record share: its seed, or for a record claimed
    before seeds existed, its :func:`legacy_key_material`; then its generation.

    The seed is a function of what the client sent, so a row lost in a failover (claimed
    again at the same generation) hands out the same keys. The generation tells apart the
    requests that reused the key after its earlier uses were deleted past their retention:
    a provider must see a new key for a new request, or it refuses the request (a known key
    with other params) or skips its call. Generation 0 is the material alone, so the keys
    of rows written before generations existed do not change."""
    material = seed if seed is not None else legacy_key_material(key_id, created_at, operation)
    if generation == 0:
        return material
    text = f"recoverypoint-generation-1\x00{material}\x00{generation}"
    return hashlib.sha256(text.encode()).hexdigest()


def derived_key_of(material: str, kind: str, *names: str) -> str:
    """The key ``kind`` derived from a record's seed (or legacy material) and ``names``;
    67 characters."""
    text = "\x00".join((kind, material, *names))
    return f"rp_{hashlib.sha256(text.encode()).hexdigest()}"


def downstream_key_of(material: str, point: str, name: str = "", renewals: int = 0) -> str:
    """The key a foreign step at ``point`` hands its provider (``StepContext.downstream_key``):
    of the record's ``material``, the call's ``name``, and a fresh one per renewal past the
    provider's window (none before the first, so keys from before renewals stay)."""
    names = (point, name, *((str(renewals),) if renewals else ()))
    return derived_key_of(material, "downstream", *names)


def is_http_status(status: object) -> bool:
    """Whether ``status`` can be a finished key's stored answer: an int from 100 to 599 (an
    ``IntEnum`` such as ``http.HTTPStatus`` too, not a bool). The key row holds no CHECK for
    it (migration 0017): a finished row without its status could never be replayed."""
    return isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599


def safe_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The headers that may be stored and replayed: a replay repeats the answer, never a
    credential, a session or what concerned one connection (see :data:`_UNSAFE_HEADERS`
    and :data:`_CREDENTIAL`)."""
    if not headers:
        return {}
    return {
        name: value
        for name, value in headers.items()
        if name.lower() not in _UNSAFE_HEADERS and _CREDENTIAL.search(name) is None
    }


# A deny-list, not an allow-list: an API's own headers (Location, ETag, X-Request-Cost...)
# describe the answer and are replayed. Refused: a session or a credential the endpoint
# handed its first caller (an access token in Authorization, a Cookie), which a retry with
# the same key, by anyone who learned the key, must not receive again; and the headers of
# one connection or one message (hop-by-hop, the body's length).
_UNSAFE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)

# Any name that says it carries a credential, standard or not: Authorization,
# Proxy-Authorization, Authentication-Info, WWW-Authenticate, Cookie, Set-Cookie,
# X-Auth-Token, X-Api-Key, X-Amz-Security-Token, X-CSRF-Token, X-Session-Id... A header
# refused by mistake is only missing from a replay; one let through by mistake is a
# credential handed out again.
_CREDENTIAL = re.compile(
    r"auth|cookie|token|session|secret|passw|api-?key|csrf|xsrf|credential|signature",
    re.IGNORECASE,
)
