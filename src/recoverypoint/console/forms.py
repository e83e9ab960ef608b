"""Reading what a visitor sends: the key and job filters of a query string, the options
of an action's form. Anything else is refused with :class:`FormError` (a 400 page that
names the field), never passed on: text that PostgreSQL would refuse (NUL, text that is
not UTF-8), numbers that do not fit a column, a single-valued field given twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import ImmutableMultiDict

from .. import admin

MAX_TEXT = 255
"""The longest key, scope or operation name the engine stores."""
MAX_MESSAGE = 500
MAX_ID = 2**63 - 1
PAGE_SIZES = (25, 50, 100, 200)
BULK_LIMIT = 1000
"""At most this many keys in one bulk action (the CLI's default --limit for actions)."""
SINCE = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}


class FormError(ValueError):
    """A field the console cannot use; ``str()`` says which and why, without echoing it."""


Fields = ImmutableMultiDict[str, Any]
"""A query string, or a POSTed form: each name may come any number of times."""


def text(fields: Fields, name: str, *, limit: int = MAX_TEXT) -> str | None:
    """One text field, stripped; ``None`` when absent or empty."""
    values = _values(fields, name)
    if len(values) > 1:
        raise FormError(f"{name} is given more than once")
    if not values:
        return None
    value = values[0]
    if not isinstance(value, str):
        raise FormError(f"{name} must be text")
    value = value.strip()
    if len(value) > limit:
        raise FormError(f"{name} is longer than {limit} characters")
    if any(ord(c) < 32 and c not in "\t\n\r" for c in value):
        raise FormError(f"{name} holds control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FormError(f"{name} is not valid text") from None
    return value or None


def number(fields: Fields, name: str, *, low: int = 1, high: int = MAX_ID) -> int | None:
    value = text(fields, name, limit=20)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or not low <= int(value) <= high:
        raise FormError(f"{name} must be a whole number from {low} to {high}")
    return int(value)


def flag(fields: Fields, name: str) -> bool:
    return text(fields, name, limit=5) in ("on", "1", "true", "yes")


def row_id(value: str | int) -> int:
    """A key's or an audit entry's id from a path: a bigint, else not found."""
    found = int(value)
    if not 1 <= found <= MAX_ID:
        raise admin.NotFound(f"there is no row {found}")
    return found


@dataclass(frozen=True)
class Selection:
    """A listing's filters as sent, normalized: for its links and its form."""

    values: tuple[tuple[str, str], ...]

    def query(self, **extra: str | int | None) -> str:
        """The query string of this selection, with ``extra`` set (``None``: dropped)."""
        pairs = [(k, v) for k, v in self.values if k not in extra]
        pairs += [(k, str(v)) for k, v in extra.items() if v is not None]
        return urlencode(pairs)

    def value(self, name: str) -> str:
        return next((v for k, v in self.values if k == name), "")


@dataclass(frozen=True)
class KeySelection(Selection):
    filter: admin.KeyFilter

    def states(self) -> set[str]:
        return {v for k, v in self.values if k == "state"}


def key_selection(fields: Fields, *, may_filter_scope: bool, bulk: bool = False) -> KeySelection:
    """The key filters of a query string (or of a bulk action's form: no paging)."""
    states = _values(fields, "state")
    if len(states) > len(admin.STATES) or any(s not in admin.STATES for s in states):
        raise FormError(f"state must be one of {', '.join(admin.STATES)}")
    chosen = tuple(s for s in admin.STATES if s in states)
    search, operation, point = text(fields, "q"), text(fields, "operation"), text(fields, "point")
    scope = text(fields, "scope")
    if scope is not None and not may_filter_scope:
        raise FormError("scope: filtering by scope needs the permission to reveal scopes")
    version = number(fields, "version", high=2**31 - 1)
    status = number(fields, "status", low=100, high=599)
    since = text(fields, "since", limit=4)
    if since is not None and since not in SINCE:
        raise FormError(f"since must be one of {', '.join(SINCE)}")
    limit = number(fields, "limit", high=max(PAGE_SIZES)) or 50
    if limit not in PAGE_SIZES:
        raise FormError(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}")
    sent: list[tuple[str, object]] = [
        ("q", search), ("operation", operation), ("version", version), ("scope", scope),
        ("point", point), ("status", status), ("since", since),
        *(("state", state) for state in chosen),
        ("limit", None if bulk or limit == 50 else limit),
    ]  # fmt: skip
    selected = admin.KeyFilter(
        operation=operation,
        version=version,
        scope=scope,
        states=chosen,
        point=point,
        status=status,
        since=datetime.now(timezone.utc) - SINCE[since] if since else None,
        search=search,
        before=None if bulk else number(fields, "before"),
        limit=BULK_LIMIT if bulk else limit,
    )
    return KeySelection(tuple((k, str(v)) for k, v in sent if v is not None), selected)


def ids(fields: Fields, name: str = "ids") -> tuple[int, ...]:
    """A bulk action's keys, as its confirmation page listed them: ``1,2,3``."""
    listed = text(fields, name, limit=BULK_LIMIT * 20) or ""
    found: list[int] = []
    for part in listed.split(","):
        if not (part.isascii() and part.isdigit()) or not 1 <= int(part) <= MAX_ID:
            raise FormError(f"{name} must be key ids separated by commas")
        found.append(int(part))
    if len(found) > BULK_LIMIT:
        raise FormError(f"{name}: at most {BULK_LIMIT} keys at once")
    return tuple(found)


@dataclass(frozen=True)
class JobSelection(Selection):
    filter: admin.JobFilter


def job_selection(fields: Fields) -> JobSelection:
    name = text(fields, "name")
    key = number(fields, "key_id")
    failing = flag(fields, "failing")
    values = [(k, str(v)) for k, v in (("name", name), ("key_id", key)) if v is not None]
    if failing:
        values.append(("failing", "on"))
    selected = admin.JobFilter(
        name=name, key_id=key, failing=failing, before=number(fields, "before"), limit=50
    )
    return JobSelection(tuple(values), selected)


def _values(fields: Fields, name: str) -> list[Any]:
    return list(fields.getlist(name))


def joined(values: Iterable[int]) -> str:
    return ",".join(map(str, values))
