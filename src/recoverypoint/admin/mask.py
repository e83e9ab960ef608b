"""Masking for listings: scopes and params name customers, and an operator's screen (or a
pasted ticket) should not. A masked value keeps its first two characters and a short hash,
so the same value masks the same way and rows can still be told apart and matched."""

from __future__ import annotations

import hashlib
from typing import Any


def mask(text: str) -> str:
    """``"alice@example.com"`` → ``"al…#6e0a1f"``; a value of 6 characters or fewer keeps
    none of them (two would give most of it away): ``"SF"`` → ``"…#661239"``."""
    if not text:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    return f"{text[:2] if len(text) > 6 else ''}…#{digest}"


def mask_json(value: Any) -> Any:
    """``value`` with every leaf masked; the structure and the object keys are kept."""
    if isinstance(value, dict):
        return {name: mask_json(item) for name, item in value.items()}
    if isinstance(value, list):
        return [mask_json(item) for item in value]
    if value is None or isinstance(value, bool):
        return value
    return mask(str(value))
