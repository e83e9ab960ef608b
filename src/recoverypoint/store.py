"""All SQL the request path runs on ``idempotency_keys`` and ``staged_jobs``.

Each statement is named after its intent; every write after the claim is fenced by the
lease's ``lock_token`` and checked by row count, so a request that lost its lease can
never commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, text

from .context import StagedJob
from .errors import LockLost

# One round trip: take the key (new, free or with an expired lease) or, when it cannot be
# taken, return the existing row so the caller can tell a replay, a mismatch and a key in
# use apart. Under SERIALIZABLE a conflicting row this snapshot cannot see raises 40001
# instead, and the claim is retried with a fresh snapshot.
_CLAIM = text(
    """
    WITH claimed AS (
        INSERT INTO idempotency_keys AS k (
            scope, operation, idempotency_key, operation_version, request_method,
            request_path, request_params, fingerprint, locked_at, lock_token)
        VALUES (:scope, :operation, :key, :version, :method,
            :path, CAST(:params AS jsonb), :fingerprint, now(), :token)
        ON CONFLICT (scope, operation, idempotency_key) DO UPDATE
            SET locked_at = now(), lock_token = EXCLUDED.lock_token, last_run_at = now()
            WHERE k.fingerprint = EXCLUDED.fingerprint
              AND k.finished_at IS NULL
              AND (k.locked_at IS NULL
                   OR k.locked_at <= now() - make_interval(secs => :lock_timeout))
        RETURNING k.id, k.created_at, k.operation_version, k.fingerprint, k.recovery_point,
                  k.state, k.request_params, k.response_status, k.response_headers,
                  k.response_body, k.attempts,
                  true AS claimed, k.xmax = 0 AS inserted, 0 AS lease_left
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT id, created_at, operation_version, fingerprint, recovery_point, state,
           request_params, response_status, response_headers, response_body, attempts,
           false, false,
           ceil(extract(epoch FROM locked_at + make_interval(secs => :lock_timeout) - now()))
    FROM idempotency_keys
    WHERE scope = :scope AND operation = :operation AND idempotency_key = :key
      AND NOT EXISTS (SELECT 1 FROM claimed)
    """
)

# Which operation and version a key record belongs to (Engine.resume looks it up by id).
_KEY_OPERATION = text("SELECT operation, operation_version FROM idempotency_keys WHERE id = :id")

# Take an unfinished key by id when its lease is free, expired or already held under
# :token (the completer claims keys in batches, then resumes each); otherwise return the
# row so the caller can tell a replay from a key in use. The lease is checked in the
# UPDATE itself, so two callers never both get it.
_CLAIM_BY_ID = text(
    """
    WITH claimed AS (
        UPDATE idempotency_keys AS k
        SET locked_at = now(), lock_token = :token, last_run_at = now()
        WHERE k.id = :id AND k.finished_at IS NULL
          AND (k.lock_token = :token OR k.locked_at IS NULL
               OR k.locked_at <= now() - make_interval(secs => :lock_timeout))
        RETURNING k.id, k.created_at, k.operation_version, k.fingerprint, k.recovery_point,
                  k.state, k.request_params, k.response_status, k.response_headers,
                  k.response_body, k.attempts, true AS claimed, false AS inserted, 0 AS lease_left
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT id, created_at, operation_version, fingerprint, recovery_point, state,
           request_params, response_status, response_headers, response_body, attempts,
           false, false,
           ceil(extract(epoch FROM locked_at + make_interval(secs => :lock_timeout) - now()))
    FROM idempotency_keys
    WHERE id = :id AND NOT EXISTS (SELECT 1 FROM claimed)
    """
)

# Renew the lease, if still ours, and lock the row for the rest of the transaction.
_FENCE = text(
    """
    UPDATE idempotency_keys SET locked_at = now()
    WHERE id = :id AND lock_token = :token
    """
)

# Commit a phase: the new recovery point and state, renewing the lease.
_ADVANCE = text(
    """
    UPDATE idempotency_keys
    SET recovery_point = :point, state = CAST(:state AS jsonb),
        locked_at = now(), last_run_at = now()
    WHERE id = :id AND lock_token = :token
    """
)

# Finish the key with its response and give the lease up.
_FINISH = text(
    """
    UPDATE idempotency_keys
    SET recovery_point = 'finished', state = CAST(:state AS jsonb),
        response_status = :status, response_headers = CAST(:headers AS jsonb),
        response_body = CAST(:body AS jsonb), finished_at = now(),
        locked_at = NULL, lock_token = NULL, last_run_at = now()
    WHERE id = :id AND lock_token = :token
    """
)

# A failed attempt: give the lease up, keep the recovery point, count and record it.
_RELEASE = text(
    """
    UPDATE idempotency_keys
    SET locked_at = NULL, lock_token = NULL, attempts = attempts + 1, last_error = :error,
        next_attempt_at = now() + make_interval(secs => :retry_in)
    WHERE id = :id AND lock_token = :token
    """
)

_STAGE_JOB = text(
    """
    INSERT INTO staged_jobs (job_name, job_args, job_key, idempotency_key_id)
    VALUES (:name, CAST(:args AS jsonb), :job_key, :key_id)
    """
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
    lock_timeout: float


@dataclass(frozen=True)
class KeyRecord:
    """The claim's view of a key record."""

    id: int
    created_at: datetime
    operation_version: int
    fingerprint: str
    recovery_point: str
    state: dict[str, Any]
    request_params: Any
    response_status: int | None
    response_headers: dict[str, str] | None
    response_body: Any
    attempts: int
    claimed: bool
    inserted: bool
    lease_left: int


def claim(conn: Connection, request: ClaimRequest) -> KeyRecord | None:
    """Take the key if it can be taken; ``None`` only if the row vanished (reaped) meanwhile."""
    row = conn.execute(
        _CLAIM,
        {
            "scope": request.scope,
            "operation": request.operation,
            "key": request.key,
            "version": request.version,
            "method": request.method,
            "path": request.path,
            "params": request.params_json,
            "fingerprint": request.fingerprint,
            "token": request.token,
            "lock_timeout": request.lock_timeout,
        },
    ).one_or_none()
    if row is None:
        return None
    return KeyRecord(**row._asdict())


def key_operation(conn: Connection, key_id: int) -> tuple[str, int] | None:
    """The operation name and version stored with key ``key_id``; ``None`` if it is gone."""
    row = conn.execute(_KEY_OPERATION, {"id": key_id}).one_or_none()
    return None if row is None else (row.operation, row.operation_version)


def claim_by_id(
    conn: Connection, key_id: int, token: UUID, lock_timeout: float
) -> KeyRecord | None:
    """Take key ``key_id`` under ``token`` if it can be taken; ``None`` if it is gone."""
    row = conn.execute(
        _CLAIM_BY_ID, {"id": key_id, "token": token, "lock_timeout": lock_timeout}
    ).one_or_none()
    return None if row is None else KeyRecord(**row._asdict())


def fence(conn: Connection, key_id: int, token: UUID) -> None:
    _fenced(conn, _FENCE, {"id": key_id, "token": token})


def advance(conn: Connection, key_id: int, token: UUID, point: str, state_json: str) -> None:
    _fenced(conn, _ADVANCE, {"id": key_id, "token": token, "point": point, "state": state_json})


def finish(
    conn: Connection,
    key_id: int,
    token: UUID,
    *,
    state_json: str,
    status: int,
    headers_json: str,
    body_json: str,
) -> None:
    _fenced(
        conn,
        _FINISH,
        {
            "id": key_id,
            "token": token,
            "state": state_json,
            "status": status,
            "headers": headers_json,
            "body": body_json,
        },
    )


def release(conn: Connection, key_id: int, token: UUID, error: str, retry_in: float) -> bool:
    """Give up the lease after a failure; ``False`` if it was already taken over."""
    result = conn.execute(
        _RELEASE, {"id": key_id, "token": token, "error": error, "retry_in": retry_in}
    )
    return result.rowcount == 1


def stage_jobs(conn: Connection, key_id: int, jobs: Sequence[StagedJob]) -> None:
    if jobs:
        conn.execute(
            _STAGE_JOB,
            [
                {"name": j.name, "args": j.args_json, "job_key": j.job_key, "key_id": key_id}
                for j in jobs
            ],
        )


def _fenced(conn: Connection, statement: Any, params: dict[str, Any]) -> None:
    if conn.execute(statement, params).rowcount != 1:
        raise LockLost()
