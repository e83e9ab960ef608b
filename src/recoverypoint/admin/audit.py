"""The audit trail: one logfmt line per operator action, on the ``recoverypoint.admin``
logger, saying who did what to which rows and how many it changed."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..logfmt import logfmt

logger = logging.getLogger("recoverypoint.admin")


def record(actor: str, action: str, changed: Iterable[int], **fields: object) -> None:
    ids = list(changed)
    line = logfmt(
        event=action,
        actor=actor,
        changed=len(ids),
        ids=",".join(map(str, ids)) or "-",
        **{name: value for name, value in fields.items() if value is not None},
    )
    logger.info(line)
