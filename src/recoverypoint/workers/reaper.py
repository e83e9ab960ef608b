"""The reaper: deletes keys once no client can still retry them, and old consume-once records.

Only finished keys are ever deleted, by the age of ``finished_at``: after their operation's
``retention``, else the reaper's ``retention`` (72 hours, the retry window clients and the
completer have); keys the completer abandoned not before the longer ``abandoned_retention``
(30 days) either, so a human has time to look at them. An unfinished key is never deleted,
however old: the completer finishes or abandons it first. Staged jobs of a deleted key keep
their row, unlinked from it (``idempotency_key_id`` set to NULL in the same statement), and
the key's next generation is recorded in the same statement (:mod:`recoverypoint.generations`),
so that a reuse of the key hands its providers new keys. Those records are pruned after
``generations_retention`` (30 days), longer than any provider remembers a key, or after the
longest ``dedupe_window`` a registered operation declares, when that is longer: until then
a provider may still remember the keys a reuse at generation 0 would derive again.

A large pass leaves dead rows behind. Where autovacuum looks after the table it reaped,
that is autovacuum's work; where it is off (for the server or the table), the reaper runs
``VACUUM (ANALYZE)`` on that table itself after a pass that deleted ``vacuum_after`` rows
or more, so the table does not bloat and the planner's estimates stay true. Several reapers
do not queue behind each other's vacuum: one that finds the table being vacuumed skips it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, NamedTuple

from sqlalchemy import TextClause, text

from .. import generations
from ..admin.base import DEFAULT_ABANDONED_RETENTION, DEFAULT_RETENTION
from ..generations import DEFAULT_GENERATIONS_RETENTION
from .engines import AnyEngine
from .loop import EVERY_SCOPE, IN_SCOPE, Result, Rows, Worker

# A duplicate delivery can come late (a broker outage, a consumer down for a weekend), and
# a record is small: keep them longer than the keys.
DEFAULT_PROCESSED_RETENTION = timedelta(days=7)

# Rows one pass deletes from a table before the reaper vacuums it (when autovacuum does not).
DEFAULT_VACUUM_AFTER = 10_000

# Whether autovacuum skips a table: off for the server, or for the table alone.
_AUTOVACUUM_OFF = text(
    """
    SELECT NOT current_setting('autovacuum')::boolean OR EXISTS (
        SELECT FROM pg_class AS c, unnest(c.reloptions) AS option
        WHERE c.oid = CAST(:table AS regclass)
          AND option ~* '^autovacuum_enabled=(false|off|no|n|f|0)$'
    )
    """
)


# The scopes with finished keys past the shortest retention, the oldest first (IN_SCOPE).
_DUE_SCOPES = text(
    """
    SELECT scope FROM idempotency_keys
    WHERE finished_at < now() - make_interval(secs => :shortest)
    GROUP BY scope ORDER BY min(finished_at) LIMIT :scopes
    """
)


# One batch of finished keys past their retention: their operation's own (``Operation(
# retention=...)``, a table from three arrays) or the reaper's. The partial index on
# finished_at finds them by the shortest retention; each row is then held to its own (a
# sub-select, not a join: Citus, which runs this batch's CTEs one by one for the INSERT
# that records generations, reads a locked join's result in the wrong format). Rows
# locked elsewhere are skipped, so reapers never wait for each other. Each deleted key's
# generation is recorded in its own scope (record_next).
def _reap_keys(rows: Rows) -> TextClause:
    return text(
        f"""
    WITH own AS (
        SELECT * FROM unnest(
            CAST(:operations AS text[]), CAST(:versions AS integer[]),
            CAST(:retentions AS double precision[])
        ) AS o(operation, version, retention)
    ), compensating AS (
        SELECT * FROM unnest(
            CAST(:compensating_operations AS text[]), CAST(:compensating_versions AS integer[])
        ) AS c(operation, version)
    ), doomed AS (
        SELECT k.id{rows.chosen("k")} FROM idempotency_keys AS k
        WHERE {rows.only}k.finished_at < now() - make_interval(secs => :shortest)
          AND k.finished_at < now() - make_interval(secs => coalesce(
              (SELECT min(o.retention) FROM own AS o
               WHERE o.operation = k.operation AND o.version = k.operation_version),
              :retention))
          AND (k.abandoned_at IS NULL
               OR k.abandoned_at < now() - make_interval(secs => :abandoned_retention))
          -- Kept while its operation's compensation is still to run (doctor reports it):
          -- deleted, what its phases did would stay with nobody told.
          AND NOT (k.compensation_due_at IS NOT NULL AND k.compensated_at IS NULL
                   AND EXISTS (SELECT FROM compensating AS c
                               WHERE c.operation = k.operation
                                 AND c.version = k.operation_version))
        LIMIT :batch_size
        FOR UPDATE OF k SKIP LOCKED
    ), deleted AS (
        DELETE FROM idempotency_keys AS k USING doomed
        WHERE {rows.same("k", "doomed")} AND k.id = doomed.id
        RETURNING k.id, k.abandoned_at IS NOT NULL AS abandoned, {generations.DELETED}
    ), {generations.record_next("deleted")}, unlinked AS (
        -- staged_jobs has no foreign key (see recoverypoint.schema): do its ON DELETE SET
        -- NULL, by the key's id (an identity, unique across scopes). A job an enqueuer is
        -- publishing right now is skipped, not waited for: it is about to be deleted, and
        -- a stale id there harms nobody.
        UPDATE staged_jobs SET idempotency_key_id = NULL
        WHERE {rows.only}id IN (
            SELECT id FROM staged_jobs
            WHERE {rows.only}idempotency_key_id IN (SELECT id FROM deleted)
            FOR UPDATE SKIP LOCKED
        )
    )
    SELECT abandoned FROM deleted
    """
    )


# The scopes with recorded generations past the generations' retention, the oldest first
# (IN_SCOPE).
_DUE_GENERATION_SCOPES = text(
    """
    SELECT scope FROM key_generations
    WHERE deleted_at < now() - make_interval(secs => :retention)
    GROUP BY scope ORDER BY min(deleted_at) LIMIT :scopes
    """
)


# One batch of recorded generations past the generations' retention: a reuse of their key
# is generation 0 again (recoverypoint.generations).
def _prune_generations(rows: Rows) -> TextClause:
    return text(
        f"""
    WITH doomed AS (
        SELECT operation, idempotency_key{rows.chosen("key_generations")} FROM key_generations
        WHERE {rows.only}deleted_at < now() - make_interval(secs => :retention)
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM key_generations AS g USING doomed
    WHERE {rows.same("g", "doomed")} AND g.operation = doomed.operation
      AND g.idempotency_key = doomed.idempotency_key
    RETURNING 1
    """
    )


# The scopes with consume-once records past their retention, the oldest first (IN_SCOPE).
_DUE_MESSAGE_SCOPES = text(
    """
    SELECT scope FROM processed_messages
    WHERE processed_at < now() - make_interval(secs => :retention)
    GROUP BY scope ORDER BY min(processed_at) LIMIT :scopes
    """
)


# One batch of consume-once records past their retention.
def _reap_messages(rows: Rows) -> TextClause:
    return text(
        f"""
    WITH doomed AS (
        SELECT consumer, message_id{rows.chosen("processed_messages")}
        FROM processed_messages
        WHERE {rows.only}processed_at < now() - make_interval(secs => :retention)
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM processed_messages AS p USING doomed
    WHERE {rows.same("p", "doomed")} AND p.consumer = doomed.consumer
      AND p.message_id = doomed.message_id
    RETURNING 1
    """
    )


class _Deletion(NamedTuple):
    """One of the reaper's deletions, in batches."""

    listing: TextClause
    """The scopes with rows due (:data:`IN_SCOPE`)."""
    in_scope: TextClause
    """A batch of one scope's rows."""
    every_scope: TextClause
    """A batch of rows of every scope."""


_KEYS = _Deletion(_DUE_SCOPES, _reap_keys(IN_SCOPE), _reap_keys(EVERY_SCOPE))
_GENERATIONS = _Deletion(
    _DUE_GENERATION_SCOPES, _prune_generations(IN_SCOPE), _prune_generations(EVERY_SCOPE)
)
_MESSAGES = _Deletion(_DUE_MESSAGE_SCOPES, _reap_messages(IN_SCOPE), _reap_messages(EVERY_SCOPE))


@dataclass
class ReaperResult(Result):
    finished: int = 0
    """Finished keys deleted."""
    abandoned: int = 0
    """Abandoned keys deleted."""
    messages: int = 0
    """Consume-once records deleted."""
    generations: int = 0
    """Recorded generations of deleted keys pruned."""
    vacuumed: int = 0
    """Tables the reaper vacuumed itself after this pass (autovacuum being off for them),
    or found another reaper vacuuming."""


class Reaper(Worker[ReaperResult]):
    """Deletes finished keys past their retention (their operation's ``retention``, else
    ``retention``), abandoned ones also past ``abandoned_retention`` (which may not be
    shorter than ``retention``), consume-once records past ``processed_retention`` and the
    recorded generations of deleted keys past ``generations_retention`` (longer than any
    provider remembers a key: see
    :data:`~recoverypoint.generations.DEFAULT_GENERATIONS_RETENTION`; never shorter than
    the longest ``dedupe_window`` of the registered operations), one
    transaction per batch; then vacuums a table it deleted ``vacuum_after`` rows or more
    from, if autovacuum does not (``None``: never)."""

    name: ClassVar[str] = "reaper"
    default_batch_size: ClassVar[int] = 1000
    default_interval: ClassVar[float] = 60.0

    def __init__(
        self,
        engine: AnyEngine | Sequence[AnyEngine],
        *,
        batch_size: int | None = None,
        retention: timedelta = DEFAULT_RETENTION,
        abandoned_retention: timedelta = DEFAULT_ABANDONED_RETENTION,
        processed_retention: timedelta = DEFAULT_PROCESSED_RETENTION,
        generations_retention: timedelta = DEFAULT_GENERATIONS_RETENTION,
        vacuum_after: int | None = DEFAULT_VACUUM_AFTER,
        stop_event: threading.Event | None = None,
    ) -> None:
        super().__init__(engine, batch_size=batch_size, stop_event=stop_event)
        if min(retention, abandoned_retention, processed_retention, generations_retention) < (
            timedelta(0)
        ):
            raise ValueError("reaper: retentions must be >= 0")
        if abandoned_retention < retention:
            raise ValueError(
                f"reaper: abandoned_retention ({abandoned_retention}) may not be shorter "
                f"than retention ({retention}): abandoned keys are kept for a human to see"
            )
        if vacuum_after is not None and vacuum_after < 1:
            raise ValueError("reaper: vacuum_after must be >= 1, or None for never")
        self.retention = retention
        self.abandoned_retention = abandoned_retention
        self.processed_retention = processed_retention
        self.generations_retention = generations_retention
        self.vacuum_after = vacuum_after
        self._window_kept: timedelta | None = None

    def _compensating(self) -> dict[str, list[Any]]:
        """The operations whose abandoned keys wait for their compensation, as binds."""
        compensating = [op for op in self.engines.operations if op.compensation_phase]
        return {
            "compensating_operations": [op.name for op in compensating],
            "compensating_versions": [op.version for op in compensating],
        }

    def run_once(self) -> ReaperResult:
        result = ReaperResult()
        own = [op for op in self.engines.operations if op.retention is not None]
        retentions = [op.retention.total_seconds() for op in own if op.retention is not None]
        keys = {
            "operations": [op.name for op in own],
            "versions": [op.version for op in own],
            "retentions": retentions,
            "retention": self.retention.total_seconds(),
            "shortest": min([self.retention.total_seconds(), *retentions]),
            "abandoned_retention": self.abandoned_retention.total_seconds(),
            **self._compensating(),
        }

        def reap(abandoned: Sequence[Any]) -> None:
            result.abandoned += sum(abandoned)
            result.finished += len(abandoned) - sum(abandoned)

        def prune(deleted: Sequence[Any]) -> None:
            result.generations += len(deleted)

        def forget(deleted: Sequence[Any]) -> None:
            result.messages += len(deleted)

        self._delete(_KEYS, keys, reap, result)
        self._delete(
            _GENERATIONS, {"retention": self._generations_kept().total_seconds()}, prune, result
        )
        self._delete(
            _MESSAGES, {"retention": self.processed_retention.total_seconds()}, forget, result
        )
        for table, deleted in (
            ("idempotency_keys", result.finished + result.abandoned),
            ("processed_messages", result.messages),
        ):
            if self.vacuum_after is not None and deleted >= self.vacuum_after:
                result.vacuumed += self._vacuum_unless_autovacuum(table)
        self.engines.observer.reaped(result.finished, result.abandoned, result.messages)
        self.engines.observer.worker_pass(self.name)
        return result

    def _delete(
        self,
        deletion: _Deletion,
        params: dict[str, Any],
        count: Callable[[Sequence[Any]], None],
        result: ReaperResult,
    ) -> None:
        """Run ``deletion`` in batches, scope by scope where the keys are distributed, of
        every scope at once otherwise (see :class:`Rows`); ``count`` is told each batch's
        rows."""

        def batch(statement: TextClause, params: dict[str, Any]) -> int:
            rows = self._batch(statement, params, result)
            count(rows)
            return len(rows)

        if self.distributed:
            self.by_scope(
                deletion.listing,
                params,
                lambda scope: batch(deletion.in_scope, {**params, "scope": scope}),
            )
        else:
            self.in_batches(lambda: batch(deletion.every_scope, params))

    def _generations_kept(self) -> timedelta:
        """How long a deleted key's generation is kept: ``generations_retention``, or the
        longest dedupe window of the registered operations' steps when that is longer (a
        provider that declared it may remember the keys a reuse at generation 0 derives
        again until then); logged once per window that wins."""
        window = max(
            (
                phase.dedupe_window
                for operation in self.engines.operations
                for phase in operation.phases
                if phase.dedupe_window is not None
            ),
            default=timedelta(0),
        )
        if window <= self.generations_retention:
            return self.generations_retention
        if window != self._window_kept:
            self._window_kept = window
            self.log(
                logging.INFO,
                "generations_retention",
                generations_retention_seconds=int(self.generations_retention.total_seconds()),
                kept_seconds=int(window.total_seconds()),
                reason="a registered foreign step's dedupe_window is longer",
            )
        return window

    def _vacuum_unless_autovacuum(self, table: str) -> bool:
        """``VACUUM (ANALYZE)`` ``table`` if autovacuum skips it; whether it did."""
        with self.db.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")  # VACUUM needs it
            if not conn.execute(_AUTOVACUUM_OFF, {"table": table}).scalar_one():
                return False
            # SKIP_LOCKED: another reaper's vacuum of the table is as good as ours.
            conn.execute(text(f"VACUUM (ANALYZE, SKIP_LOCKED) {table}"))  # our name, not input
        return True

    def _batch(
        self, statement: TextClause, params: dict[str, Any], result: ReaperResult
    ) -> Sequence[Any]:
        """Delete one batch in its own transaction; what the statement returned per row."""
        with self.db.begin() as conn:
            returned = conn.execute(statement, {**params, "batch_size": self.batch_size})
            rows = returned.scalars().all()
        result.batches += 1
        return rows
