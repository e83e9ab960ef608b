"""All SQL the request path runs on ``idempotency_keys`` and ``staged_jobs``.

Each statement is named after its intent; every write after the claim is fenced by the
lease's ``lock_token`` and checked by row count, so a request that lost its lease can
never commit.

The statements run on psycopg, in the transactions of :mod:`recoverypoint._pg`, together
with the phase's own writes. Three things keep them cheap:

- a finished key is looked up on its own before any transaction begins: a replay costs one
  round trip and writes nothing;
- after the claim, the key row is addressed by its ``ctid`` (the row version's physical
  address, which each statement returns anew). Under SERIALIZABLE that takes a predicate
  lock on the row alone, where a lookup through the primary key would lock the index page
  that every new key is inserted into, and concurrent requests would keep aborting each
  other with 40001. When the address is stale (a rolled-back attempt, a takeover) the
  statement runs again by ``id``;
- the write that records a phase is addressed by the ``ctid`` its own transaction's fence
  (or claim) returned, which nobody else can change while the row is locked, and carries
  the phase's staged jobs in the same statement. A miss means the phase itself changed the
  key row or ended the transaction: the engine raises :data:`LockLost` and never commits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, cast
from uuid import UUID

import psycopg
import sqlalchemy as sa
from psycopg.rows import args_row

from ._pg import Transaction, borrowed
from .context import StagedJob
from .errors import KeyInUse, LockLost

# JSON columns come back as their text: the engine parses what it uses, once.
_RECORD_COLUMNS = """
    id, created_at, operation_version, fingerprint, recovery_point, state::text,
    request_params::text, response_status, response_headers, response_body::text, attempts,
    ctid::text AS ctid, pg_current_xact_id_if_assigned()::text AS xid
"""

# How long the lease has been held, in seconds; NULL when it is free. The caller judges it
# against the lock timeout of the version that started the key, which SQL does not know.
_HELD_FOR = "extract(epoch FROM now() - locked_at)::float8"

# One round trip: insert the key, or, when it exists, return its row so the caller can tell
# a replay, a mismatch, a key in use and a key to resume apart (by the rules of the version
# that started it, which may not be the caller's). An existing row is read,
# not locked: a replay writes nothing, so its transaction commits without a WAL flush; a
# key to resume is then taken with _CLAIM_BY_ID. Under SERIALIZABLE a conflicting row this
# snapshot cannot see raises 40001, and the claim is retried with a fresh snapshot.
_CLAIM = f"""
    WITH claimed AS (
        INSERT INTO idempotency_keys (
            scope, operation, idempotency_key, operation_version, request_method,
            request_path, request_params, fingerprint, locked_at, lock_token)
        VALUES (%(scope)s, %(operation)s, %(key)s, %(version)s, %(method)s,
            %(path)s, %(params)s::jsonb, %(fingerprint)s, now(), %(token)s)
        ON CONFLICT (scope, operation, idempotency_key) DO NOTHING
        RETURNING {_RECORD_COLUMNS}, true AS claimed, true AS inserted, NULL::float8 AS held_for
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT {_RECORD_COLUMNS}, false, false, {_HELD_FOR}
    FROM idempotency_keys
    WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
      AND NOT EXISTS (SELECT 1 FROM claimed)
"""

# Take an unfinished key by id when its lease is free, expired or already held under
# :token (the completer claims keys in batches, then resumes each); otherwise return the
# row so the caller can tell a replay from a key in use. The lease is checked in the
# UPDATE itself, so two callers never both get it.
_CLAIM_BY_ID = f"""
    WITH claimed AS (
        UPDATE idempotency_keys AS k
        SET locked_at = now(), lock_token = %(token)s, last_run_at = now()
        WHERE k.id = %(id)s AND k.finished_at IS NULL
          AND (k.lock_token = %(token)s OR k.locked_at IS NULL
               OR k.locked_at <= now() - make_interval(secs => %(lock_timeout)s))
        RETURNING {_RECORD_COLUMNS}, true AS claimed, false AS inserted, NULL::float8 AS held_for
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT {_RECORD_COLUMNS}, false, false, {_HELD_FOR}
    FROM idempotency_keys
    WHERE id = %(id)s AND NOT EXISTS (SELECT 1 FROM claimed)
"""

# A finished key, read before any transaction: a replay needs nothing else. A finished
# row never changes until the reaper deletes it.
_FINISHED = f"""
    SELECT {_RECORD_COLUMNS}, false AS claimed, false AS inserted, NULL::float8 AS held_for
    FROM idempotency_keys
    WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
      AND finished_at IS NOT NULL
"""

# The transaction a connection is in, once it wrote (phase_guard's last check).
_CURRENT_TRANSACTION = "SELECT pg_current_xact_id_if_assigned()::text"

# Which operation and version a key record belongs to (Engine.resume looks it up by id).
_KEY_OPERATION = "SELECT operation, operation_version FROM idempotency_keys WHERE id = %(id)s"

# The fenced statements below end with {where}, written out when the module loads: by
# address first, by id when the address is stale. Each returns the row's new address and
# the transaction it ran in (which must be the phase's own, see phase_guard), then what
# the statement names in ``returning``.
_BY_CTID = "ctid = %(ctid)s::tid AND id = %(id)s AND lock_token = %(token)s"
_BY_ID = "id = %(id)s AND lock_token = %(token)s"


class _Fenced(NamedTuple):
    by_ctid: str
    by_id: str
    held: str
    """By ctid, in the transaction whose fence or claim locked the row (see ``xid``): the
    write that records an atomic phase."""
    held_staging: str
    """:attr:`held`, inserting the phase's staged jobs in the same statement."""


# The phase's staged jobs, as arrays in job order; inserted only when the write that records
# the phase found its row.
_STAGED = """
    INSERT INTO staged_jobs (job_name, job_args, job_key, idempotency_key_id, trace_context)
    SELECT job.name, job.args::jsonb, job.job_key, %(id)s, job.trace_context
    FROM unnest(%(job_names)s::text[], %(job_args)s::text[], %(job_keys)s::text[],
                %(job_traces)s::text[]) WITH ORDINALITY
         AS job(name, args, job_key, trace_context, n)
    WHERE EXISTS (SELECT FROM written)
    ORDER BY job.n
"""


def _by_ctid_and_by_id(sql: str, returning: str = "") -> _Fenced:
    def written_out(where: str) -> str:
        return f"{sql.format(where=where)} RETURNING ctid::text, pg_current_xact_id()::text" + (
            f", {returning}" if returning else ""
        )

    # Also in the phase's own transaction: phase code that ended it cannot have the point
    # recorded in another.
    held = written_out(f"pg_current_xact_id()::text = %(xid)s AND {_BY_CTID}")
    staging = f"WITH written AS ({held}), staged AS ({_STAGED}) SELECT * FROM written"
    return _Fenced(written_out(_BY_CTID), written_out(_BY_ID), held, staging)


# Lock the row for the rest of the transaction, if the lease is still ours. The lease is
# renewed by the write that commits the phase: a renewal here would be seen by nobody
# (no other transaction sees it before that write replaces it) and would cost a row version.
_FENCE = """
    SELECT ctid::text, pg_current_xact_id()::text FROM idempotency_keys WHERE {where}
    FOR UPDATE
"""
_FENCE_BY_CTID = _FENCE.format(where=_BY_CTID)
_FENCE_BY_ID = _FENCE.format(where=_BY_ID)

# Commit a phase: the new recovery point and state, renewing the lease from this moment
# (clock_timestamp(), not now(): that is the transaction's start, and a phase that ran for
# longer than the lock timeout would leave its successor no lease at all). Only from the
# point the run started the phase at: a recovery point never moves backwards, even when a
# run records a step's result after the phase that followed it did commit (an ambiguous
# COMMIT failure).
_ADVANCE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET recovery_point = %(point)s, state = %(state)s::jsonb,
        locked_at = clock_timestamp(), last_run_at = now()
    WHERE recovery_point = %(from_point)s AND {where}
""",
    returning="state::text",
)

# Finish the key with its response and give the lease up. The state and the body come back
# as jsonb stored them (1e16 as an integer...), so that the first answer and every replay,
# a fresh run and a resumed one, see the same values.
_FINISH = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET recovery_point = 'finished', state = %(state)s::jsonb,
        response_status = %(status)s, response_headers = %(headers)s::jsonb,
        response_body = %(body)s::jsonb, finished_at = now(),
        locked_at = NULL, lock_token = NULL, last_run_at = now()
    WHERE {where}
""",
    returning="response_body::text",
)

# A failed attempt: give the lease up, keep the recovery point, count and record it.
_RELEASE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET locked_at = NULL, lock_token = NULL, attempts = attempts + 1, last_error = %(error)s,
        next_attempt_at = now() + make_interval(secs => %(retry_in)s)
    WHERE {where}
"""
)

# A request withdrawn by its first phase (see operation.Withdrawn): forget the key, as long
# as nothing was recorded under it.
_WITHDRAW = _by_ctid_and_by_id(
    "DELETE FROM idempotency_keys WHERE recovery_point = 'started' AND {where}"
)


@dataclass(frozen=True)
class ClaimRequest:
    scope: str
    operation: str
    key: str
    version: int
    method: str
    path: str
    params_json: str
    fingerprint: str
    token: UUID


@dataclass(frozen=True)
class KeyRecord:
    """The claim's view of a key record."""

    id: int
    created_at: datetime
    operation_version: int
    fingerprint: str
    recovery_point: str
    state: str
    """The state as JSON text, and the params and body below likewise."""
    request_params: str
    response_status: int | None
    response_headers: dict[str, str] | None
    response_body: str | None
    attempts: int
    ctid: str
    xid: str | None
    """The claim's transaction, once it wrote the row (a new key)."""
    claimed: bool
    inserted: bool
    held_for: float | None

    def lease_left(self, lock_timeout: float) -> int:
        """Whole seconds until the lease expires under ``lock_timeout``; 0 when free."""
        if self.held_for is None:
            return 0
        return max(0, math.ceil(lock_timeout - self.held_for))


@dataclass
class KeyRef:
    """Where a claimed key is, and the lease it is held under."""

    id: int
    token: UUID
    ctid: str
    xid: str | None = None
    """The transaction of the last fenced write: a phase must commit in the one it began in."""
    locked_by: Transaction | None = None
    """The transaction whose fence or claim locked the row at ``ctid``, if still open."""


def finished_key(tx: Transaction, request: ClaimRequest) -> KeyRecord | None:
    """The key if it is finished, read before the transaction begins."""
    params = {"scope": request.scope, "operation": request.operation, "key": request.key}
    return tx.lookup(_FINISHED, params, args_row(KeyRecord))


def claim(tx: Transaction, request: ClaimRequest) -> KeyRecord | None:
    """Take the key if it can be taken; ``None`` only if the row vanished (reaped) meanwhile."""
    params = {
        "scope": request.scope,
        "operation": request.operation,
        "key": request.key,
        "version": request.version,
        "method": request.method,
        "path": request.path,
        "params": request.params_json,
        "fingerprint": request.fingerprint,
        "token": request.token,
    }
    return _fetch_record(tx, _CLAIM, params)


def claim_by_id(tx: Transaction, key_id: int, token: UUID, lock_timeout: float) -> KeyRecord | None:
    """Take key ``key_id`` under ``token`` if it can be taken; ``None`` if it is gone.
    ``lock_timeout``: the operation's, of the version that started the key."""
    params = {"id": key_id, "token": token, "lock_timeout": lock_timeout}
    return _fetch_record(tx, _CLAIM_BY_ID, params)


def key_operation(db: sa.Engine, key_id: int) -> tuple[str, int] | None:
    """The operation name and version stored with key ``key_id``; ``None`` if it is gone."""
    with borrowed(db) as (_, connection):
        row = connection.execute(_KEY_OPERATION, {"id": key_id}).fetchone()
    return None if row is None else (row[0], row[1])


def fence(tx: Transaction, key: KeyRef) -> None:
    """Lock the row while the lease is ours, or raise :class:`LockLost`; :class:`KeyInUse` when
    the database's lock or statement timeout ends the wait for another holder's row lock."""
    params = {"id": key.id, "token": key.token, "ctid": key.ctid}
    with _waiting_for_key():
        row = tx.fetchone(_FENCE_BY_CTID, params)
        if row is None:  # a stale address: a rolled-back attempt, a takeover
            row = tx.fetchone(_FENCE_BY_ID, params)
    _written(key, row)
    key.locked_by = tx


def held(tx: Transaction, key: KeyRef, record: KeyRecord) -> None:
    """Note that ``tx``'s claim inserted the key row (and so holds it)."""
    key.ctid, key.xid, key.locked_by = record.ctid, record.xid, tx


def advance(
    tx: Transaction,
    key: KeyRef,
    jobs: Sequence[StagedJob],
    from_point: str,
    point: str,
    state_json: str,
) -> Any:
    """Record ``point`` and ``state`` and commit; return the state as stored."""
    params = {"from_point": from_point, "point": point, "state": state_json}
    return _commit_fenced(tx, key, _ADVANCE, params, jobs)


def finish(
    tx: Transaction,
    key: KeyRef,
    jobs: Sequence[StagedJob],
    *,
    state_json: str,
    status: int,
    headers_json: str,
    body_json: str,
) -> Any:
    """Finish the key with its response and commit; return the body as stored."""
    params = {"state": state_json, "status": status, "headers": headers_json, "body": body_json}
    return _commit_fenced(tx, key, _FINISH, params, jobs)


def release(db: sa.Engine, key: KeyRef, error: str, retry_in: float) -> bool:
    """Give up the lease after a failure; ``False`` if it was already taken over."""
    return _fenced_alone(db, key, _RELEASE, {"error": error, "retry_in": retry_in})


def withdraw(db: sa.Engine, key: KeyRef) -> bool:
    """Delete the key if it is still at ``started`` and ours; ``False`` if it was not."""
    return _fenced_alone(db, key, _WITHDRAW, {})


def current_transaction(tx: Transaction) -> str | None:
    """The id of the transaction ``tx``'s connection is in, if it has written anything."""
    row = tx.connection.execute(_CURRENT_TRANSACTION).fetchone()
    return None if row is None else cast("str | None", row[0])


@contextmanager
def _waiting_for_key() -> Iterator[None]:
    """A wait for the key row that the role's ``lock_timeout`` or ``statement_timeout``
    cut short means another request holds the key: :class:`KeyInUse`, not a 500."""
    try:
        yield
    except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
        raise KeyInUse(
            "another request with this key is running: the database's lock or statement "
            "timeout ended the wait for it; retry with the same key after the Retry-After delay",
            retry_after=1,
        ) from exc


def _fetch_record(tx: Transaction, sql: str, params: dict[str, Any]) -> KeyRecord | None:
    with _waiting_for_key():
        record: KeyRecord | None = tx.fetchone(sql, params, args_row(KeyRecord))
    return record


def _commit_fenced(
    tx: Transaction, key: KeyRef, sql: _Fenced, params: dict[str, Any], jobs: Sequence[StagedJob]
) -> Any:
    """Run a fenced write, then COMMIT: in the transaction that holds the row, with the
    jobs; else (a step's result committed on its own) by address, then by id."""
    assert key.locked_by is tx or not jobs, "jobs are staged by atomic phases only"
    params = {**params, "id": key.id, "token": key.token, "ctid": key.ctid, "xid": key.xid}
    if key.locked_by is tx:
        if jobs:
            params["job_names"] = [job.name for job in jobs]
            params["job_args"] = [job.args_json for job in jobs]
            params["job_keys"] = [job.job_key for job in jobs]
            params["job_traces"] = [job.trace_context for job in jobs]
        row = tx.fetchone(sql.held_staging if jobs else sql.held, params)
        if row is None:
            # The write missed the row its own transaction locked: the phase itself changed
            # the key row, or ended the transaction. Nothing is committed.
            raise LockLost(
                "the key row changed under the phase (phase code must not write to "
                "idempotency_keys); nothing was committed: retry with the same key"
            )
    else:  # a foreign step's result, committed on its own: it stages no jobs
        with _waiting_for_key():
            row = tx.fetchone(sql.by_ctid, params)
            if row is None:
                row = tx.fetchone(sql.by_id, params)
    if row is not None:
        tx.commit()  # the phase and its recovery point, together
    return _written(key, row)[2]


def _fenced_alone(db: sa.Engine, key: KeyRef, sql: _Fenced, params: dict[str, Any]) -> bool:
    """A fenced write in a transaction of its own; ``False`` when the lease is not ours."""
    params = {**params, "id": key.id, "token": key.token, "ctid": key.ctid}
    with borrowed(db) as (_, connection), _waiting_for_key():
        row = connection.execute(sql.by_ctid, params).fetchone()
        if row is None:
            row = connection.execute(sql.by_id, params).fetchone()
    return row is not None


def _written(key: KeyRef, row: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """Record the row's new address and transaction, or raise :class:`LockLost`."""
    if row is None or row[0] is None:
        raise LockLost()
    key.ctid, key.xid = row[0], row[1]
    return row
