"""Masking for listings and key pages: scopes, params, phase outputs, stored responses and
request fingerprints name customers, and an operator's screen (or a pasted ticket) should
not, nor a console viewer who may not reveal them.

A masked value is a keyed digest and nothing else: an HMAC-SHA-256 under the
installation's own secret (``installation_secrets``, made by the database at migration
0010, and shown by no page), so that the same value masks the same way wherever it is
shown and rows can still be told apart and matched, while nobody without the secret can
test a guess against it (an amount, a PIN, a scope: an unkeyed digest of so few
possibilities is reversed in seconds). No character of the value is kept, nor its length.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

_SECRET = sa.text("SELECT secret FROM installation_secrets WHERE name = 'mask'")


@dataclass(frozen=True)
class Mask:
    """Masks values under ``secret``: ``mask("alice@example.com")`` → ``"…#4f0c3a9d21"``."""

    secret: bytes = field(repr=False)

    @classmethod
    def of(cls, db: sa.Engine) -> Mask:
        """The installation's mask, its secret read from ``db``."""
        with db.connect() as conn:
            secret = conn.execute(_SECRET).scalar_one_or_none()
        if secret is None:
            raise LookupError(
                "the database has no secret to mask values with: run `recoverypoint migrate`"
            )
        return cls(bytes(secret))

    def __call__(self, text: str) -> str:
        if not text:
            return text
        data = text.encode("utf-8", "surrogatepass")
        return f"…#{hmac.new(self.secret, data, hashlib.sha256).hexdigest()[:10]}"

    def json(self, value: Any) -> Any:
        """``value`` with every leaf masked; the structure and the object keys are kept."""
        if isinstance(value, dict):
            return {name: self.json(item) for name, item in value.items()}
        if isinstance(value, list):
            return [self.json(item) for item in value]
        if value is None or isinstance(value, bool):
            return value
        return self(str(value))
