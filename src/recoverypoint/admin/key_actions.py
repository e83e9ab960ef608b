"""Changing keys: retry, release, abandon, reopen, delete, purge, reconcile; one key or
many (reconcile: one).

Every action is fenced like the engine's own writes. It is decided on rows as they were
read (their id and lease token), then applied in one UPDATE or DELETE whose WHERE checks
that condition again, on the row as it is when the statement gets it: a key whose lease
changed hands, or that finished, since it was read is left alone and reported. So an
action never races a running phase into a double effect:

- ``release`` clears the lease only while the token it saw still holds it; a forced
  release of a live lease clears it anyway, and the holder's next fenced write (every
  engine write checks ``lock_token``) fails with :class:`~recoverypoint.LockLost` and
  rolls back;
- ``abandon`` finishes a key only while it is unfinished and the lease it saw (or none)
  still holds it, expired unless forced;
- ``delete`` of an unfinished key needs ``force``: a retry would start over under a new id,
  with new downstream keys, and repeat its foreign steps.

A statement that finds the row locked by a running phase waits ``Admin.lock_wait``
seconds at most, then refuses. Every action that runs (not a dry run) writes an audit line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from .. import generations
from ..keys import canonical_json
from ..leases import free_before
from ..operation import FINISHED
from . import audit
from ._sql import KEY_COLUMNS, REGISTERED
from .base import ABANDONED, NEEDS_RECONCILIATION, Admin, Refused
from .keys import KeyFilter, KeyRow, find_key, list_keys

DEFAULT_ABANDON_STATUS = 500
DEFAULT_ABANDON_MESSAGE = "This request was abandoned by an operator and will not be retried."
SAMPLE_SIZE = 5
ABANDON_EFFECTS = (
    "What its committed phases did stays (a charge, a row), unless its operation declares a "
    "compensation, which the next completer pass runs; `recoverypoint keys show ID` says which. "
    "Undo what stays by hand."
)
"""What an operator is told as they abandon keys (the CLI, the console)."""


@dataclass(frozen=True)
class ActionResult:
    """What an action found and did."""

    action: str
    matched: int
    """Keys the selection found."""
    eligible: tuple[int, ...]
    """Those the action applied to, as they were read."""
    changed: tuple[int, ...]
    """Those it changed; the rest changed meanwhile and were left alone."""
    dry_run: bool = False
    sample: tuple[KeyRow, ...] = ()
    """A dry run's first eligible keys."""
    audit_id: int | None = None
    """The action's row in ``audit_log`` (``None`` for a dry run)."""

    @property
    def skipped(self) -> tuple[int, ...]:
        done = set(self.changed)
        return tuple(i for i in self.eligible if i not in done)


# The keys of one scope as they were read: each statement below names the scope, so on
# Citus it runs on that scope's shard alone. ``free_before`` is each lease's deadline
# (:func:`recoverypoint.leases.free_before`) on the transaction's ``now()`` and the timeout
# its holder stored, which holds as long as its token does (Citus refuses ``now()`` with
# column references in an UPDATE).
_SEEN = """
    seen AS (
        SELECT * FROM unnest(
            CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]), CAST(:free_before AS timestamptz[])
        ) AS s(id, lock_token, free_before)
    )
"""

# Not live, judged as the lease's holder judges it; NULL (so: live) when its timeout is unknown.
_FREE_AS_SEEN = "(k.locked_at IS NULL OR k.locked_at <= s.free_before)"

_RETRY = sa.text(
    f"""
    WITH {_SEEN}
    UPDATE idempotency_keys AS k
    SET next_attempt_at = now(), retried_at = now(),
        attempts = CASE WHEN :reset THEN 0 ELSE k.attempts END
    FROM seen AS s
    WHERE k.scope = :scope AND k.id = s.id AND k.finished_at IS NULL
      AND k.reconcile_since IS NULL
    RETURNING k.id
    """
)

# Only the lease that was seen; a live one only when forced.
_RELEASE = sa.text(
    f"""
    WITH {_SEEN}
    UPDATE idempotency_keys AS k
    SET locked_at = NULL, lock_token = NULL
    FROM seen AS s
    WHERE k.scope = :scope AND k.id = s.id AND k.finished_at IS NULL
      AND k.lock_token = s.lock_token AND (:force OR {_FREE_AS_SEEN})
    RETURNING k.id
    """
)

# As the completer abandons a key: finished with an error response, its lease cleared,
# its operation's compensation, if it declares one, due at once (workers.compensator,
# which skips one that already ran: a key reopened after it); only while the lease it was
# read with (or none) still holds it, and, unforced, is free.
_ABANDON = sa.text(
    f"""
    WITH {_SEEN}
    UPDATE idempotency_keys AS k
    SET finished_at = now(), abandoned_at = now(),
        compensation_due_at = now(),
        response_status = :status,
        response_headers = '{{}}'::jsonb, response_body = CAST(:body AS jsonb),
        locked_at = NULL, lock_token = NULL
    FROM seen AS s
    WHERE k.scope = :scope AND k.id = s.id AND k.finished_at IS NULL
      AND k.lock_token IS NOT DISTINCT FROM s.lock_token AND (:force OR {_FREE_AS_SEEN})
    RETURNING k.id
    """
)

# The completer's own abandonment, due for a compensation as above: only while the key
# is unfinished, out of attempts, and its lease is the completer's or free (a client may
# have taken it since the attempt failed; then the client's attempt decides), and not
# held for an operator's reconciliation (abandoned, its step's first call would be
# forgotten with it).
_ABANDON_EXHAUSTED = sa.text(
    """
    UPDATE idempotency_keys
    SET finished_at = now(), abandoned_at = now(),
        compensation_due_at = now(),
        response_status = :status,
        response_headers = '{}'::jsonb, response_body = CAST(:body AS jsonb),
        locked_at = NULL, lock_token = NULL
    WHERE scope = :scope AND id = :id AND finished_at IS NULL AND attempts >= :max_attempts
      AND (lock_token IS NULL OR lock_token = :token) AND reconcile_since IS NULL
    RETURNING idempotency_key, recovery_point, attempts, last_error
    """
)

# Abandoned → unfinished, at the recovery point it was abandoned at, due at once; its
# compensation no longer awaited (one running now misses its fence), its failures forgotten.
_REOPEN = sa.text(
    f"""
    WITH {_SEEN}
    UPDATE idempotency_keys AS k
    SET finished_at = NULL, abandoned_at = NULL,
        compensation_due_at = NULL, compensation_attempts = 0, response_status = NULL,
        response_headers = NULL, response_body = NULL, next_attempt_at = now(),
        attempts = CASE WHEN :reset THEN 0 ELSE k.attempts END
    FROM seen AS s
    WHERE k.scope = :scope AND k.id = s.id
      AND k.abandoned_at IS NOT NULL AND k.recovery_point <> 'finished'
      AND k.compensated_at IS NULL AND k.lock_token IS NOT DISTINCT FROM s.lock_token
      AND {_FREE_AS_SEEN}
    RETURNING k.id
    """
)

# Staged jobs keep their row, unlinked, as the reaper leaves them.
_DELETE = sa.text(
    f"""
    WITH {_SEEN},
    deleted AS (
        DELETE FROM idempotency_keys AS k USING seen AS s
        WHERE k.scope = :scope AND k.id = s.id
          AND (k.finished_at IS NOT NULL
               OR (:force AND k.lock_token IS NOT DISTINCT FROM s.lock_token))
        RETURNING k.id, {generations.DELETED}
    ),
    {generations.record_next("deleted")},
    unlinked AS (
        UPDATE staged_jobs AS j SET idempotency_key_id = NULL
        FROM deleted AS d WHERE j.scope = :scope AND j.idempotency_key_id = d.id
    )
    SELECT id FROM deleted
    """
)

# A key held for reconciliation, resolved as its step's reconcile hook would have: the
# step's result found (``:found``), recorded as the step's recovery point with the state
# merged, as the engine records a step; or nothing found, and the step is called anew with
# a fresh downstream key (a renewal). Due now either way, whatever the completer's
# --min-age (the operator decided for the client, as with a retry), at the point it was
# read at, and only while no lease holds it (a held key gave its lease up).
_RECONCILE = sa.text(
    f"""
    WITH {_SEEN}
    UPDATE idempotency_keys AS k
    SET recovery_point = CASE WHEN :found THEN :step ELSE k.recovery_point END,
        state = CASE WHEN :found THEN k.state || CAST(:result AS jsonb) ELSE k.state END,
        window_renewals = CASE WHEN :found THEN 0 ELSE k.window_renewals + 1 END,
        point_reached_at = now(), reconcile_since = NULL, next_attempt_at = now(),
        retried_at = now()
    FROM seen AS s
    WHERE k.scope = :scope AND k.id = s.id AND k.finished_at IS NULL
      AND k.reconcile_since IS NOT NULL AND k.recovery_point = :point
      AND k.lock_token IS NULL
    RETURNING k.id
    """
)

_PURGEABLE = """
    k.finished_at < now() - make_interval(secs => :older_than)
    AND (:abandoned OR k.abandoned_at IS NULL)
"""

# The scopes holding purgeable keys, a page at a time (after the last page's last scope):
# each is then purged on its own, so on Citus every batch runs on one shard.
_PURGE_SCOPES = sa.text(
    f"""
    SELECT DISTINCT k.scope FROM idempotency_keys AS k
    WHERE {_PURGEABLE} AND (CAST(:after AS text) IS NULL OR k.scope > :after)
    ORDER BY k.scope
    LIMIT :batch_size
    """
)

_PURGE_BATCH = sa.text(
    f"""
    WITH doomed AS (
        SELECT k.id FROM idempotency_keys AS k
        WHERE k.scope = :scope AND {_PURGEABLE}
        ORDER BY k.finished_at
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ),
    deleted AS (
        DELETE FROM idempotency_keys AS k USING doomed
        WHERE k.scope = :scope AND k.id = doomed.id
        RETURNING k.id, {generations.DELETED}
    ),
    {generations.record_next("deleted")},
    unlinked AS (
        UPDATE staged_jobs AS j SET idempotency_key_id = NULL
        FROM deleted AS d WHERE j.scope = :scope AND j.idempotency_key_id = d.id
    )
    SELECT id FROM deleted
    """
)

_PURGE_COUNT = sa.text(f"SELECT count(*) FROM idempotency_keys AS k WHERE {_PURGEABLE}")

_PURGE_SAMPLE = sa.text(
    f"""
    WITH {REGISTERED}
    SELECT {KEY_COLUMNS} FROM idempotency_keys AS k
    WHERE {_PURGEABLE}
    ORDER BY k.finished_at
    LIMIT :limit
    """
)

# Why an action does not apply to a key as read; None when it does.
_Check = Callable[[KeyRow, bool], "str | None"]


def _retryable(row: KeyRow, force: bool) -> str | None:
    if row.finished:
        hint = "; reopen it to run it again" if row.state == ABANDONED else ""
        return f"key {row.id} is {row.state} (status {row.status}): nothing to retry{hint}"
    if row.state == NEEDS_RECONCILIATION:
        return (
            f"key {row.id} needs reconciliation: a retry could call its step again after its "
            "provider forgot the first call. Find out what that call did, then run "
            f"`recoverypoint keys reconcile {row.id} --found JSON` (its result) or "
            "`--not-found` (call it anew)"
        )
    return None


def _reconcilable(row: KeyRow, force: bool) -> str | None:
    if row.state != NEEDS_RECONCILIATION:
        return f"key {row.id} is {row.state}: it does not wait for reconciliation"
    return None


def _releasable(row: KeyRow, force: bool) -> str | None:
    if row.finished or row.lock_token is None:
        return f"key {row.id} holds no lease ({row.state}): nothing to release"
    if row.live and not force:
        return _live_lease(row, "release")
    return None


def _abandonable(row: KeyRow, force: bool) -> str | None:
    if row.finished:
        return f"key {row.id} is already {row.state} (status {row.status})"
    if row.live and not force:
        return _live_lease(row, "abandon")
    return None


def _reopenable(row: KeyRow, force: bool) -> str | None:
    if row.state != ABANDONED:
        return f"key {row.id} is {row.state}: only abandoned keys reopen"
    if row.point == FINISHED:
        return f"key {row.id} was abandoned after its last phase: there is nothing to run"
    if row.compensated_at is not None:
        return (
            f"key {row.id} was compensated at {row.compensated_at:%Y-%m-%d %H:%M:%S}: its "
            "operation's compensation undid what its phases did, and reopened it would run "
            "the rest of them on top of the undo; send the request again under a new key"
        )
    if row.live:
        return f"key {row.id} is being compensated (a live lease): wait for it, then look again"
    return None


def _deletable(row: KeyRow, force: bool) -> str | None:
    if not row.finished and not force:
        return (
            f"key {row.id} is {row.state}: deleted, a retry would start it over under a new "
            "id and new downstream keys, and repeat its foreign steps; abandon it instead, "
            "or pass --force"
        )
    return None


def _live_lease(row: KeyRow, verb: str) -> str:
    return (
        f"key {row.id} is held by a live lease ({_left(row)}, token "
        f"{row.lock_token}): a request is running it. Wait for the lease to end, or "
        f"{verb} with --force: the holder's next write then fails with LockLost and rolls back"
    )


def _left(row: KeyRow) -> str:
    if row.lease_left is None:
        return "it was taken before migration 0010 and its deadline is unknown"
    return f"{row.lease_left:.0f}s left"


def available(row: KeyRow) -> tuple[str, ...]:
    """The actions (``retry``, ``release``, ``abandon``, ``reopen``) that apply to ``row``
    as it was read, unforced: what a console offers for the key."""
    checks = {
        "retry": _retryable,
        "release": _releasable,
        "abandon": _abandonable,
        "reopen": _reopenable,
    }
    return tuple(name for name, check in checks.items() if check(row, False) is None)


def retry(
    admin: Admin,
    target: int | KeyFilter,
    *,
    reset_attempts: bool = False,
    dry_run: bool = False,
) -> ActionResult:
    """Make unfinished keys due now, optionally with their attempts counted from zero: the
    completer takes them on its next pass, whatever its ``min_age`` (the operator decides
    for their clients)."""
    return _act(admin, "keys.retry", target, _retryable, _RETRY, dry_run, reset=reset_attempts)


def reconcile(
    admin: Admin,
    key_id: int,
    *,
    found: Mapping[str, Any] | None,
    dry_run: bool = False,
) -> ActionResult:
    """Resolve key ``key_id``, held for reconciliation, as its step's reconcile hook would:
    ``found``, the step's result (what the step would have returned), recorded as the
    step's; ``None``, nothing found: the step is called anew, with a fresh downstream key.
    Either way the key is due now, for the completer or its client."""
    row = find_key(admin, key_id, reveal=True).row
    reason = _reconcilable(row, False)
    if reason is not None:
        raise Refused(reason)
    step = ""
    result = "{}"
    if found is not None:
        operation = admin.operation(row.operation, row.version)
        if operation is None:
            raise Refused(
                f"key {key_id} is of {row.operation} v{row.version}, which is not known here: "
                "name the application (--app) so that its step's result can be recorded"
            )
        step = operation.phases[operation.next_phase(row.point)].point
        try:
            result = canonical_json(dict(found))
        except ValueError as exc:
            raise ValueError(f"the result found cannot be stored: it is {exc}") from None
    return _act(
        admin,
        "keys.reconcile",
        key_id,
        _reconcilable,
        _RECONCILE,
        dry_run,
        found=found is not None,
        point=row.point,
        step=step,
        result=result,
    )


def release(
    admin: Admin, target: int | KeyFilter, *, force: bool = False, dry_run: bool = False
) -> ActionResult:
    """Clear expired leases; live ones too with ``force`` (their holder then fails with
    LockLost at its next write, and the key can be taken over at once)."""
    return _act(admin, "keys.release", target, _releasable, _RELEASE, dry_run, force=force)


def abandon(
    admin: Admin,
    target: int | KeyFilter,
    *,
    status: int = DEFAULT_ABANDON_STATUS,
    message: str = DEFAULT_ABANDON_MESSAGE,
    force: bool = False,
    dry_run: bool = False,
) -> ActionResult:
    """Finish unfinished keys with a stored error response that retries replay, as the
    completer does after ``max_attempts``."""
    if not 400 <= status <= 599:
        raise ValueError(f"an abandoned key answers with an error: status 400 to 599, not {status}")
    body = canonical_json({"error": "request_abandoned", "message": message})
    return _act(
        admin,
        "keys.abandon",
        target,
        _abandonable,
        _ABANDON,
        dry_run,
        force=force,
        status=status,
        body=body,
    )


def abandon_exhausted(
    db: sa.Engine,
    scope: str,
    key_id: int,
    token: UUID,
    max_attempts: int,
    status: int,
    body: Any,
) -> sa.Row[Any] | None:
    """Abandon key ``key_id`` of ``scope`` as the completer does, fenced by its lease
    ``token``: if it is still unfinished and has counted ``max_attempts`` attempts. The key's
    row (its key, point, attempts and last error), or ``None`` when it was not abandoned."""
    params = {
        "scope": scope,
        "id": key_id,
        "token": token,
        "max_attempts": max_attempts,
        "status": status,
        "body": canonical_json(body),
    }
    with db.begin() as conn:
        return conn.execute(_ABANDON_EXHAUSTED, params).one_or_none()


def reopen(
    admin: Admin,
    target: int | KeyFilter,
    *,
    reset_attempts: bool = True,
    dry_run: bool = False,
) -> ActionResult:
    """Make abandoned keys unfinished again, due now, at the recovery point they stopped
    at. Attempts restart from zero unless told otherwise, or the completer would abandon
    them again at once."""
    return _act(admin, "keys.reopen", target, _reopenable, _REOPEN, dry_run, reset=reset_attempts)


def delete(
    admin: Admin, target: int | KeyFilter, *, force: bool = False, dry_run: bool = False
) -> ActionResult:
    """Delete finished keys; unfinished ones only with ``force``."""
    return _act(admin, "keys.delete", target, _deletable, _DELETE, dry_run, force=force)


def purge(
    admin: Admin,
    older_than: timedelta,
    *,
    include_abandoned: bool = False,
    dry_run: bool = False,
    batch_size: int = 1000,
) -> ActionResult:
    """Delete keys finished more than ``older_than`` ago (by the database's clock), in
    batches of one transaction each, as the reaper does; abandoned ones only if asked."""
    params: dict[str, Any] = {
        **admin.params(),
        "older_than": older_than.total_seconds(),
        "abandoned": include_abandoned,
    }
    with admin.db.connect() as conn:
        matched = int(conn.execute(_PURGE_COUNT, params).scalar_one())
        sample = tuple(
            replace(KeyRow(**r._mapping), scope=admin.mask(r.scope))
            for r in conn.execute(_PURGE_SAMPLE, {**params, "limit": SAMPLE_SIZE})
        )
    if dry_run:
        return ActionResult("keys.purge", matched, (), (), dry_run=True, sample=sample)
    params["batch_size"] = batch_size
    deleted: list[int] = []
    after: str | None = None
    while True:
        with admin.db.connect() as conn:
            scopes = list(conn.execute(_PURGE_SCOPES, {**params, "after": after}).scalars())
        for scope in scopes:
            while True:
                with admin.db.begin() as conn:
                    batch = list(conn.execute(_PURGE_BATCH, {**params, "scope": scope}).scalars())
                deleted += batch
                if len(batch) < batch_size:
                    break
        if len(scopes) < batch_size:
            break
        after = scopes[-1]
    # Batches commit one by one, as the reaper's do: the record follows the last one.
    with admin.db.begin() as conn:
        entry = audit.record(
            conn,
            admin,
            "keys.purge",
            deleted,
            matched=matched,
            older_than=f"{older_than.total_seconds():g}s",
            abandoned=include_abandoned,
        )
    return ActionResult("keys.purge", matched, tuple(deleted), tuple(deleted), audit_id=entry)


def _act(
    admin: Admin,
    action: str,
    target: int | KeyFilter,
    check: _Check,
    statement: sa.TextClause,
    dry_run: bool,
    **params: Any,
) -> ActionResult:
    """Read the target, decide, apply fenced. One key: a reason not to is :class:`Refused`
    (so is a key that changed in between). Many: keys the action does not apply to are
    passed over, and the result tells how many it changed."""
    force = bool(params.get("force", False))
    # Scopes are read unmasked, to route each statement to its scope's shard; only the
    # dry run's sample leaves this function, masked.
    if isinstance(target, int):
        rows = [find_key(admin, target, reveal=True).row]
        reason = check(rows[0], force)
        if reason is not None:
            raise Refused(reason)
    else:
        rows = list_keys(admin, target, reveal=True)
    eligible = [row for row in rows if check(row, force) is None]
    ids = tuple(row.id for row in eligible)
    if dry_run:
        sample = tuple(replace(r, scope=admin.mask(r.scope)) for r in eligible[:SAMPLE_SIZE])
        return ActionResult(action, len(rows), ids, (), True, sample)
    changed, entry = _apply(admin, action, statement, eligible, params, matched=len(rows))
    if isinstance(target, int) and not changed:
        raise Refused(
            f"key {target} changed since it was read (its lease or state moved on): "
            f"nothing was done; look again with `recoverypoint keys show {target}`"
        )
    return ActionResult(action, len(rows), ids, changed, audit_id=entry)


def _apply(
    admin: Admin,
    action: str,
    statement: sa.TextClause,
    eligible: Sequence[KeyRow],
    params: dict[str, Any],
    *,
    matched: int,
) -> tuple[tuple[int, ...], int]:
    """Apply ``statement`` to the eligible rows, fenced, and record it in the same
    transaction: the ids it changed and the audit entry's id."""
    fields = {name: value for name, value in params.items() if name != "body"}
    try:
        with admin.db.begin() as conn:
            changed: tuple[int, ...] = ()
            if eligible:
                # A running phase holds its key's row lock until it commits: wait that
                # long at most, never behind a stuck transaction. As SET LOCAL commands,
                # which Citus sends on to the workers (where the rows are locked) once told
                # to; PostgreSQL keeps the citus setting as an unused placeholder.
                conn.exec_driver_sql("SET LOCAL citus.propagate_set_commands = 'local'")
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(admin.lock_wait * 1000)}")
                now = conn.execute(sa.text("SELECT now()")).scalar_one()
                found: list[int] = []
                for scope, rows in _by_scope(eligible).items():
                    seen = {
                        "scope": scope,
                        "ids": [r.id for r in rows],
                        "tokens": [r.lock_token for r in rows],
                        "free_before": [free_before(now, r.lock_timeout) for r in rows],
                    }
                    found += conn.execute(statement, {**params, **seen}).scalars()
                changed = tuple(sorted(found))
            entry = audit.record(conn, admin, action, changed, matched=matched, **fields)
            return changed, entry
    except OperationalError as exc:
        if isinstance(exc.orig, psycopg.errors.LockNotAvailable):
            raise Refused(
                "a running phase is writing these keys; nothing was done: try again in a moment"
            ) from exc
        raise


def _by_scope(rows: Sequence[KeyRow]) -> dict[str, list[KeyRow]]:
    groups: dict[str, list[KeyRow]] = {}
    for row in rows:
        groups.setdefault(row.scope, []).append(row)
    return groups
