"""The audit trail: one row of ``audit_log`` per operator action, written in the action's
own transaction (a change never commits without its record), and one logfmt line on the
``recoverypoint.admin`` logger, saying who did what to which rows and how many it changed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..keys import canonical_json
from ..logfmt import logfmt
from .base import Admin, NotFound

logger = logging.getLogger("recoverypoint.admin")

_INSERT = sa.text(
    """
    INSERT INTO audit_log (actor, via, action, matched, ids, details)
    VALUES (:actor, :via, :action, :matched, CAST(:ids AS bigint[]), CAST(:details AS jsonb))
    RETURNING id
    """
)

_SELECT = sa.text(
    """
    SELECT id, at, actor, via, action, matched, ids, details FROM audit_log
    WHERE (CAST(:id AS bigint) IS NULL OR id = :id)
      AND (CAST(:before AS bigint) IS NULL OR id < :before)
    ORDER BY id DESC
    LIMIT :limit
    """
)


@dataclass(frozen=True)
class AuditEntry:
    """One action as ``audit_log`` holds it."""

    id: int
    at: datetime
    actor: str
    via: str
    """``cli``, ``console`` or ``library``."""
    action: str
    """``keys.retry``, ``keys.abandon``, ``jobs.delete``…"""
    matched: int
    ids: list[int]
    """The rows it changed: key records, or staged jobs for ``jobs.*``."""
    details: dict[str, Any]
    """The action's options (``force``, ``status``…)."""


def record(
    conn: sa.Connection,
    admin: Admin,
    action: str,
    changed: Iterable[int],
    *,
    matched: int,
    **fields: object,
) -> int:
    """Write ``action``'s row on ``conn`` (inside the action's transaction) and its log
    line; the row's id."""
    ids = list(changed)
    details = {name: value for name, value in fields.items() if value is not None}
    entry = conn.execute(
        _INSERT,
        {
            "actor": admin.actor,
            "via": admin.via,
            "action": action,
            "matched": matched,
            "ids": ids,
            "details": canonical_json(details),
        },
    ).scalar_one()
    line = logfmt(
        event=action,
        actor=admin.actor,
        changed=len(ids),
        ids=",".join(map(str, ids)) or "-",
        matched=matched,
        **details,
    )
    logger.info(line)
    return int(entry)


def audit_entries(admin: Admin, *, before: int | None = None, limit: int = 50) -> list[AuditEntry]:
    """The newest actions first; ``before`` an id for the next page (keyset, not OFFSET)."""
    with admin.db.connect() as conn:
        found = conn.execute(_SELECT, {"id": None, "before": before, "limit": limit})
        return [AuditEntry(**row._mapping) for row in found]


def find_audit_entry(admin: Admin, entry_id: int) -> AuditEntry:
    with admin.db.connect() as conn:
        row = conn.execute(_SELECT, {"id": entry_id, "before": None, "limit": 1}).one_or_none()
    if row is None:
        raise NotFound(f"there is no audit entry {entry_id}")
    return AuditEntry(**row._mapping)
