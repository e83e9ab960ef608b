"""Pure functions on keys and params: validation, canonical JSON, fingerprints, derived keys.

Nothing here touches the database, so every rule can be read (and tested) on its own.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from .errors import InvalidKey, RequestTooLarge

MAX_KEY_LENGTH = 255
MAX_SCOPE_LENGTH = 255
DEFAULT_MAX_PARAMS_BYTES = 64 * 1024

# Printable ASCII, as the IETF draft's sf-string allows; rules out NUL, controls and
# look-alike Unicode that would make two keys print the same.
_KEY_PATTERN = re.compile(r"[\x20-\x7e]+")
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
    if not isinstance(scope, str) or len(scope) > MAX_SCOPE_LENGTH or "\x00" in scope:
        raise ValueError(
            f"scope must be a str of at most {MAX_SCOPE_LENGTH} characters without NUL, "
            f"got {scope!r:.80}"
        )
    return scope


def canonical_json(value: Any) -> str:
    """Serialise ``value`` the same way every time, so equal params hash equal.

    Raises :class:`ValueError` for values JSON cannot carry or PostgreSQL's jsonb cannot
    store (NaN, infinities, NUL characters).
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON-serialisable: {exc}") from exc
    if _ESCAPED_NUL.search(text):
        raise ValueError("contains a NUL character, which PostgreSQL cannot store")
    return text


def check_size(text: str, limit: int) -> None:
    """Raise :class:`RequestTooLarge` when ``text`` takes more than ``limit`` bytes."""
    size = len(text.encode())
    if size > limit:
        raise RequestTooLarge(f"the params take {size} bytes; the limit is {limit}")


def fingerprint(method: str, path: str, params_json: str) -> str:
    """SHA-256 of the canonical request: a reused key must carry the same one."""
    digest = hashlib.sha256()
    for part in (method.upper(), path, params_json):
        digest.update(part.encode())
        digest.update(b"\x00")
    return digest.hexdigest()


def derived_key(
    kind: str, key_id: int, created_at: datetime, *names: str, operation: str = ""
) -> str:
    """A key derived from one key record, for a foreign system or a job consumer.

    It depends only on stored fields of the record, so it is the same across retries,
    lease takeovers and completer runs; the record's id and creation time make it unique
    even when several databases share one foreign account; hashing hides the scope and the
    client's key. 67 characters at most.
    """
    # The instant, not its rendering: the session's TimeZone must not change the key.
    created = created_at.astimezone(timezone.utc).isoformat()
    material = "\x00".join((kind, operation, str(key_id), created, *names))
    return f"rp_{hashlib.sha256(material.encode()).hexdigest()}"


def safe_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The headers that may be stored and replayed: never cookies or hop-by-hop headers."""
    if not headers:
        return {}
    return {name: value for name, value in headers.items() if name.lower() not in _UNSAFE_HEADERS}


_UNSAFE_HEADERS = frozenset(
    {
        "set-cookie",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
