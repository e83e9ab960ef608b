"""What a completer does about the keys of operation versions its application does not
register: it never claims, locks or writes them; it says whose they are.

Each pass first records what the completer can finish (:data:`recoverypoint.running.RECORD`),
then lists the keys due that it cannot: unfinished and due as it claims them, or abandoned
and awaiting a compensation (which it cannot tell the version declares), by operation and
version, with whether another running completer registers the version:

- another does: they are that one's (a deploy rolling from one version to the next, two
  applications on one database), reported at INFO (``event=unregistered``);
- none does, and some are unfinished: no worker can finish them, a deploy whose ``--app``
  module misses an import, say. Reported as an error naming the version and the ``--app``,
  and what to import (``event=unfinishable``); counted by the observer
  (:meth:`Observer.keys_unfinishable`); ``recoverypoint worker --once`` then fails.
- none does, and all are abandoned: a warning (``event=compensations_unregistered``), not
  an error. Every abandonment makes a compensation due, declared or not, so a retired
  version's abandoned keys wait here until the reaper deletes them: that version declaring
  no compensation, nothing is owed, and nobody here can tell.

Each is logged when what a pass finds differs from what the last one found, not on every
pass; the observer is told every pass.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..leases import REGISTERED
from ..running import FORGET_STOPPED, KNOWN, RECORD

if TYPE_CHECKING:
    from .loop import Worker

_RECORD = sa.text(RECORD)
_FORGET_STOPPED = sa.text(FORGET_STOPPED)

# Not one of the versions the completer registers (a NOT EXISTS, so a NULL can never hide one).
_NOT_REGISTERED = """
    NOT EXISTS (SELECT 1 FROM registered AS r
                WHERE r.operation = k.operation AND r.version = k.operation_version)
"""


def listing(due: str, compensation_due: str) -> sa.TextClause:
    """The keys of versions the completer does not register that are ``due`` (SQL on key row
    ``k``: the completer's rule) or ``compensation_due`` (the compensator's), by operation
    and version, and whether some running completer registers it: read only."""
    return sa.text(
        f"""
        WITH {REGISTERED}, {KNOWN},
        due AS (
            SELECT k.operation, k.operation_version, 1 AS keys, 0 AS compensations
            FROM idempotency_keys AS k WHERE {due} AND {_NOT_REGISTERED}
            UNION ALL
            SELECT k.operation, k.operation_version, 0, 1
            FROM idempotency_keys AS k WHERE {compensation_due} AND {_NOT_REGISTERED}
        )
        SELECT d.operation, d.operation_version AS version,
               sum(d.keys)::integer AS keys, sum(d.compensations)::integer AS compensations,
               EXISTS (SELECT 1 FROM known AS o
                       WHERE o.operation = d.operation AND o.version = d.operation_version)
                   AS elsewhere
        FROM due AS d
        GROUP BY d.operation, d.operation_version
        ORDER BY d.operation, d.operation_version
        """
    )


@dataclass(frozen=True)
class Found:
    """The keys of one version a pass found and could not finish."""

    keys: int
    compensations: int
    elsewhere: bool
    """Another running completer registers the version: they are its to finish."""

    @property
    def total(self) -> int:
        return self.keys + self.compensations

    @property
    def unfinishable(self) -> int:
        """The unfinished keys no running completer can finish."""
        return 0 if self.elsewhere else self.keys


class Unregistered:
    """One completer's record of what it can finish, and its reports of what it cannot."""

    def __init__(self, worker: Worker[Any], listing: sa.TextClause) -> None:
        self.worker = worker
        self.listing = listing
        self.completer = uuid.uuid4()  # the row this completer's record is
        self._reported: dict[tuple[str, int], Found] = {}
        self._counted: set[str] = set()  # the operations the observer was last told of

    def record(self, conn: sa.Connection, registered: dict[str, Any]) -> None:
        """Record what this completer can finish (``registered``: the bind parameters of
        :data:`~recoverypoint.leases.REGISTERED`), and forget the completers no longer
        running."""
        fields = {
            "completer": self.completer,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "interval": self.worker.longest_wait,
        }
        conn.execute(_RECORD, {**registered, **fields})
        conn.execute(_FORGET_STOPPED)

    def report(self, conn: sa.Connection, params: dict[str, Any]) -> tuple[int, int]:
        """List the keys this completer cannot finish (``params``: the listing's bind
        parameters) and report them; how many there are, and how many of them are
        unfinished keys no running completer can finish."""
        found = {
            (row.operation, row.version): Found(row.keys, row.compensations, row.elsewhere)
            for row in conn.execute(self.listing, params)
        }
        by_operation = dict.fromkeys(self._counted, 0)  # told 0 once none are left
        for (name, _), what in found.items():
            if what.unfinishable:
                by_operation[name] = by_operation.get(name, 0) + what.unfinishable
        for name, keys in by_operation.items():
            self.worker.engines.observer.keys_unfinishable(name, keys)
        self._counted = {name for name, keys in by_operation.items() if keys}
        if found != self._reported:
            for (name, version), what in found.items():
                self._log(name, version, what)
            self._reported = found
        return sum(w.total for w in found.values()), sum(w.unfinishable for w in found.values())

    def _log(self, name: str, version: int, what: Found) -> None:
        fields = {
            "operation": name,
            "version": version,
            "keys": what.keys,
            "compensations": what.compensations,
        }
        if what.elsewhere:
            hint = "another running completer registers this version: they are left to it"
            self.worker.log(logging.INFO, "unregistered", **fields, hint=hint)
            return
        if not what.keys:
            self.worker.log(
                logging.WARNING,
                "compensations_unregistered",
                **fields,
                app=" ".join(self.worker.app) or "-",
                hint=f"no running completer registers {name!r} v{version}: if it declares a "
                f"compensation, none runs until one does ({self.worker.how_to_register('it')}); "
                "a retired version that declares none owes nothing, and the reaper deletes "
                "these keys after the abandoned keys' retention",
            )
            return
        self.worker.log(
            logging.ERROR,
            "unfinishable",
            **fields,
            app=" ".join(self.worker.app) or "-",
            hint=f"no running completer registers {name!r} v{version}, so no worker can "
            f"finish these keys: {self.worker.how_to_register('it')}",
        )
