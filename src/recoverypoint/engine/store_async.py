"""The request path's statements (named in :mod:`recoverypoint.engine.sql`) on
``idempotency_keys`` and ``staged_jobs``, run in the transactions of
:mod:`recoverypoint.engine._pg_async`, together with the phase's own writes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

import psycopg
import sqlalchemy.ext.asyncio as sa_async

from .. import distribute
from ..backoff import backoff_delay
from ..errors import ConfigurationError, KeyInUse, LockLost
from . import sql
from ._decide import ClaimRequest, Finished, KeyId, KeyRecord, KeyRef, Requested, written
from ._pg_async import AsyncTransaction, TextRow, borrowed
from .context.common import StagedJob


async def finished_key(
    tx: AsyncTransaction,
    requested: Requested,
    retention: float,
    *,
    bound: bool,
    meanwhile: Callable[[], object] | None = None,
) -> tuple[Finished | None, int]:
    """The key if it is finished, read before the transaction begins, and the generation a
    new row of the key takes after it (for :func:`forget_expired`; for :func:`claim` too
    where the keys are distributed, ``bound``); ``retention``: the seconds it is honoured
    for. ``meanwhile``: client work to do with the lookup (see
    :meth:`AsyncTransaction.lookup`)."""
    params = {
        "scope": requested.scope,
        "operation": requested.operation,
        "key": requested.key,
        "retention": retention,
    }
    statement = sql.FIND_FINISHED_BOUND if bound else sql.FIND_FINISHED
    row = await tx.lookup(statement, params, meanwhile)
    if row is None or row[0] is None:  # none (one server), or the joins' empty row (Citus)
        return None, 0 if row is None else int(row[6] or 0)
    return Finished.parse(row[:6]), int(row[6] or 0)


async def forget_expired(
    tx: AsyncTransaction, request: ClaimRequest, retention: float, generation: int
) -> None:
    """Delete the key if it finished more than ``retention`` seconds ago (and was not
    abandoned), so that the claim that follows in ``tx`` makes it anew, and record its next
    ``generation`` (as :func:`finished_key` read it)."""
    params = {
        "scope": request.scope,
        "operation": request.operation,
        "key": request.key,
        "retention": retention,
        "generation": generation,
    }
    with _waiting_for_key:
        await tx.fetch(sql.PAST_RETENTION, params)


async def claim(
    tx: AsyncTransaction,
    request: ClaimRequest,
    token: UUID,
    generation: int,
    schedule: dict[str, Any],
    *,
    bound: bool,
) -> KeyRecord | None:
    """Take the key under the lease ``token`` if it can be taken, a new row at its recorded
    generation (read by the claim on one server; ``generation``, as :func:`finished_key`
    read it, where the keys are distributed); ``None`` only if the row vanished (reaped)
    meanwhile.
    ``schedule``: when the next attempt is due should this one fail
    (:func:`recoverypoint.backoff.sql_params`). ``bound``: the keys are distributed by
    Citus (see :func:`bind`)."""
    first_delay = backoff_delay(
        0, base=schedule["retry_base"], cap=schedule["retry_cap"], jitter=schedule["jitter"]
    )
    seed = request.seed
    params = {
        "first_delay": first_delay,
        "generation": generation,
        "scope": request.scope,
        "operation": request.operation,
        "key": request.key,
        "version": request.version,
        "method": request.method,
        "path": request.path,
        "params": request.params_json,
        "fingerprint": request.fingerprint,
        "seed": seed,
        "token": token,
        "lock_timeout": request.lock_timeout,
        "tx": tx.token,
    }
    with _waiting_for_key:
        row = await tx.fetch(sql.CLAIM_BOUND if bound else sql.CLAIM, params)
    if row is not None:
        return KeyRecord.new_row(row, request, seed)
    return await _fetch_record(tx, sql.CLAIMED_BEFORE, params)


async def claim_by_id(
    tx: AsyncTransaction, key: KeyId, schedule: dict[str, Any]
) -> KeyRecord | None:
    """Take the key if it can be taken, and has attempts left; ``None`` if it is gone.
    ``schedule``: as :func:`claim`'s."""
    params = {**schedule, **key._asdict()}
    return await _fetch_record(tx, sql.CLAIM_BY_ID, params)


async def abandon_exhausted(tx: AsyncTransaction, key: KeyId, status: int, body_json: str) -> Any:
    """Finish the key, out of attempts, with the answer ``status`` and ``body_json``; return
    the body as stored, or ``None`` when the key was not abandoned (it has attempts left, or
    its lease is another's)."""
    params = {**key._asdict(), "status": status, "body": body_json}
    row = await tx.fetch(sql.ABANDON_EXHAUSTED, params)
    return None if row is None else row[0]


async def key_operation(
    db: sa_async.AsyncEngine, key_id: int, scope: str | None
) -> tuple[str, int, str] | None:
    """The operation name and version stored with key ``key_id``, and its scope; ``None``
    if it is gone (or not in ``scope``, when one is given)."""
    statement = sql.KEY_OPERATION_ANY_SCOPE if scope is None else sql.KEY_OPERATION
    async with borrowed(db) as (_, connection):
        cursor = await connection.execute(statement, {"id": key_id, "scope": scope})
        row = await cursor.fetchone()
    return None if row is None else (row[0], row[1], row[2])


async def distributed(db: sa_async.AsyncEngine) -> bool:
    """Whether ``idempotency_keys`` is distributed by Citus, so that each phase is bound to
    its scope's worker (:data:`recoverypoint.engine.sql.BIND`); :class:`ConfigurationError`
    if the keys are distributed without the trigger that binds a new key's first phase
    (:data:`recoverypoint.distribute.BINDS_NEW_KEY`)."""
    async with borrowed(db) as (_, connection):
        for query in (distribute.CITUS_INSTALLED, sql.KEYS_DISTRIBUTED):
            cursor = await connection.execute(query)
            row = await cursor.fetchone()
            if not (row and row[0]):
                return False
        cursor = await connection.execute(distribute.NEW_KEYS_BOUND)
        row = await cursor.fetchone()
    if not (row and row[0]):
        raise ConfigurationError(distribute.TRIGGER_MISSING)
    return True


async def fence(tx: AsyncTransaction, key: KeyRef, *, bound: bool) -> None:
    """Lock the row while the lease is ours, or raise :class:`LockLost`; :class:`KeyInUse` when
    the database's lock or statement timeout ends the wait for another holder's row lock.
    ``bound``: the transaction is bound to the scope's worker too (see :func:`bind`)."""
    params = {
        "scope": key.scope,
        "ctid": key.ctid,
        "id": key.id,
        "token": key.token,
        "tx": tx.token,
    }
    with _waiting_for_key:
        row = await tx.fetch(sql.FENCE_BOUND if bound else sql.FENCE, params)
        if row is None:  # a stale address: a rolled-back attempt, a takeover
            row = await tx.fetchone(sql.FENCE_BY_ID_BOUND if bound else sql.FENCE_BY_ID, params)
    written(key, row)
    key.locked_by, key.fence_left_to = tx, None


def fence_later(tx: AsyncTransaction, key: KeyRef) -> None:
    """Leave the fence of a phase that sends no statement of its own to the write that
    records it (:func:`advance`, :func:`finish`), which then is the fence: it finds the row
    by address and lease as :func:`fence` does, locks it, and misses it (and raises, so
    nothing commits) where the fence would have; only then are a stale address and a lost
    lease told apart, as :func:`fence` tells them. A round trip less for such a phase
    (``@idempotent``'s answer). Only for a phase that sends no statement: one that did
    would have run it unfenced (:func:`_record` refuses that)."""
    key.locked_by = key.fence_left_to = tx


def held(tx: AsyncTransaction, key: KeyRef, record: KeyRecord) -> None:
    """Note that ``tx``'s claim inserted the key row (and so holds it)."""
    key.ctid, key.locked_by = record.ctid, tx


async def bind(tx: AsyncTransaction, key: KeyRef) -> None:
    """Bind ``tx``, which holds the key row, to the scope's worker on Citus: its COMMIT then
    fails with :class:`PhaseLeftWorker` if it wrote on another worker too
    (:data:`recoverypoint.engine.sql.BIND`). A claim that inserted the key row bound its
    transaction already (:data:`recoverypoint.distribute.BINDS_NEW_KEY`)."""
    await tx.fetch(sql.BIND, {"scope": key.scope, "id": key.id})


async def advance(
    tx: AsyncTransaction,
    key: KeyRef,
    jobs: Sequence[StagedJob],
    from_point: str,
    point: str,
    state_json: str,
    *,
    bound: bool,
) -> Any:
    """Record ``point`` and ``state`` and commit; return the state as stored."""
    params = {"from_point": from_point, "point": point, "state": state_json}
    return await _commit_fenced(tx, key, sql.ADVANCE, params, jobs, bound)


async def finish(
    tx: AsyncTransaction,
    key: KeyRef,
    jobs: Sequence[StagedJob],
    *,
    state_json: str,
    status: int,
    headers_json: str,
    body_json: str,
    bound: bool,
) -> Any:
    """Finish the key with its response and commit; return the body as stored."""
    params = {"state": state_json, "status": status, "headers": headers_json, "body": body_json}
    return await _commit_fenced(tx, key, sql.FINISH, params, jobs, bound)


async def renew_window(
    tx: AsyncTransaction, key: KeyRef, point: str, renewals: int, *, bound: bool
) -> int:
    """Count a renewal of the dedupe window of the step after ``point``, from ``renewals``
    (see :data:`~recoverypoint.engine.sql.RENEW_WINDOW`), and commit; the new count."""
    params = {"point": point, "renewals": renewals}
    return int(await _commit_fenced(tx, key, sql.RENEW_WINDOW, params, (), bound))


async def hold(db: sa_async.AsyncEngine, key: KeyRef, reason: str) -> bool:
    """Hold the key for an operator's reconciliation and give the lease up; ``False`` if
    the lease was already taken over."""
    return await _fenced_alone(db, key, sql.HOLD, {"error": reason})


async def fence_abandoned(
    tx: AsyncTransaction, scope: str, key_id: int, token: UUID
) -> KeyRecord | None:
    """Lock abandoned key ``key_id`` for its compensation, if it still awaits one under the
    lease ``token``; ``None`` when it does not."""
    params = {"scope": scope, "id": key_id, "token": token}
    return await _fetch_record(tx, sql.FENCE_ABANDONED, params)


async def compensated(
    tx: AsyncTransaction,
    key: KeyRef,
    jobs: Sequence[StagedJob],
    state_json: str,
    *,
    bound: bool,
) -> None:
    """Record the compensation of the key ``tx`` holds, with its jobs, and commit."""
    await _commit_fenced(tx, key, sql.COMPENSATE, {"state": state_json}, jobs, bound)


async def release(db: sa_async.AsyncEngine, key: KeyRef, error: str, retry_in: float) -> bool:
    """Give up the lease after a failure; ``False`` if it was already taken over."""
    return await _fenced_alone(db, key, sql.RELEASE, {"error": error, "retry_in": retry_in})


async def withdraw(db: sa_async.AsyncEngine, key: KeyRef) -> bool:
    """Delete the key if it is still at ``started`` and ours; ``False`` if it was not."""
    return await _fenced_alone(db, key, sql.WITHDRAW, {})


class PhaseEndedTransaction(Exception):
    """The write that records a phase ran in another transaction than the phase began in:
    phase code ended its own (the engine raises :class:`TransactionEnded`)."""


class PhaseLeftWorker(Exception):
    """Citus refused to commit a phase that left its scope: bound to its scope's worker
    (:func:`bind`), it wrote on another worker too, or it wrote another scope's
    rows on its own (``recoverypoint.distribute.STAYS_IN_SCOPE``); nothing committed (the
    engine raises :class:`PhaseLeftScope`)."""


class _WaitingForKey:
    """A wait for the key row that the role's ``lock_timeout`` or ``statement_timeout``
    cut short means another request holds the key: :class:`KeyInUse`, not a 500. (A class
    rather than a generator: every claim and fence enters it.)"""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, psycopg.errors.LockNotAvailable | psycopg.errors.QueryCanceled):
            raise KeyInUse(
                "another request with this key is running: the database's lock or statement "
                "timeout ended the wait for it; retry with the same key after the Retry-After "
                "delay",
                retry_after=1,
            ) from exc


_waiting_for_key = _WaitingForKey()


async def _fetch_record(
    tx: AsyncTransaction, statement: sql.Statement, params: dict[str, Any]
) -> KeyRecord | None:
    with _waiting_for_key:
        row = await tx.fetch(statement, params)
    return None if row is None else KeyRecord.parse(row)


def _found_by(key: KeyRef) -> dict[str, Any]:
    """The parameters that find a fenced write's row, and wake the key's waiters."""
    return {
        "scope": key.scope,
        "id": key.id,
        "token": key.token,
        "ctid": key.ctid,
        "wake_lock": key.wake_lock,
        "wake_channel": key.wake_channel,
    }


async def _commit_fenced(
    tx: AsyncTransaction,
    key: KeyRef,
    statement: sql.Fenced,
    params: dict[str, Any],
    jobs: Sequence[StagedJob],
    bound: bool,
) -> Any:
    """Run a fenced write, then COMMIT: in the transaction that holds the row, with the
    jobs; else (a step's result committed on its own) by address, then by id. ``bound``:
    the keys are distributed (Citus), where the write and its jobs go as plain statements
    (:attr:`~recoverypoint.engine.sql.Fenced.bound`)."""
    assert key.locked_by is tx or not jobs, "jobs are staged by atomic phases only"
    params = {**params, **_found_by(key)}
    if key.locked_by is tx:
        params["tx"] = tx.token
        for i, job in enumerate(jobs):
            params[f"job_name_{i}"] = job.name
            params[f"job_args_{i}"] = job.args_json
            params[f"job_key_{i}"] = job.job_key
            params[f"job_trace_{i}"] = job.trace_context
        try:  # the phase and its recovery point, committed together
            if bound:
                row = await _record_bound(tx, statement, params, len(jobs))
            else:
                write = statement.staging(len(jobs)) if jobs else statement.held
                row = await _record(tx, key, write, params)
        except psycopg.Error as exc:
            # The write missed the row its own transaction locked (it raises then, so that
            # COMMIT never runs): the phase itself changed the key row, or ended the
            # transaction. Nothing is committed.
            if exc.sqlstate == sql.TRANSACTION_ENDED:
                raise PhaseEndedTransaction() from None
            if (
                exc.diag.message_primary == sql.LEFT_ITS_WORKER
                or exc.sqlstate == distribute.LEFT_ITS_SCOPE
            ):
                raise PhaseLeftWorker() from exc
            if exc.sqlstate == sql.KEY_ROW_CHANGED:
                raise LockLost(
                    "the key row changed under the phase (phase code must not write to "
                    "idempotency_keys); nothing was committed: retry with the same key"
                ) from None
            raise
        return written(key, row)[1]
    # A foreign step's result, committed on its own: it stages no jobs.
    with _waiting_for_key:
        row = await tx.fetchone(statement.by_ctid, params)
        if row is None:
            row = await tx.fetchone(statement.by_id, params)
    if row is not None:
        await tx.commit()
    return written(key, row)[1]


async def _record(
    tx: AsyncTransaction, key: KeyRef, write: sql.Statement, params: dict[str, Any]
) -> TextRow | None:
    """The write that records a phase, then COMMIT, in one round trip; the phase's fence
    too, where it was left to the write (:func:`fence_later`)."""
    if key.fence_left_to is not tx:
        return await tx.fetch_and_commit(write, params)
    key.fence_left_to = None
    # Rolled back and written again below, a statement of the phase would be lost.
    assert not tx.began, "a phase that left its fence to its write sent a statement"
    try:
        with _waiting_for_key:
            return await tx.fetch_and_commit(write, params)
    except psycopg.Error as exc:
        if exc.sqlstate != sql.KEY_ROW_CHANGED:
            raise
    # The write missed its row: a stale address (a rolled-back attempt, a takeover) or a
    # lost lease. Fenced on its own, by id when the address is stale: LockLost if the
    # lease is gone, else the write again at the row's address.
    await tx.roll_back()
    await fence(tx, key, bound=False)
    return await tx.fetch_and_commit(write, {**params, "ctid": key.ctid})


async def _record_bound(
    tx: AsyncTransaction, statement: sql.Fenced, params: dict[str, Any], jobs: int
) -> TextRow | None:
    """The write that records a phase where the keys are distributed, then its jobs and the
    wake-up, each a statement of its own, the last in one round trip with COMMIT; a write
    that missed its row raises as the guarded one does on one server
    (:data:`~recoverypoint.engine.sql.MISSED`), and nothing after it is sent."""
    row = await tx.fetch(statement.bound, params)
    if row is None:
        await tx.fetch(sql.MISSED, params)  # raises, saying which miss it was
        return None
    after = [sql.staged_jobs(jobs)] if jobs else []
    after += [sql.WAKE] if statement.wakes else []
    for each in after[:-1]:
        await tx.fetch(each, params)
    if after:
        await tx.fetch_and_commit(after[-1], params)
    else:
        await tx.commit()
    return row


async def _fenced_alone(
    db: sa_async.AsyncEngine, key: KeyRef, statement: sql.Fenced, params: dict[str, Any]
) -> bool:
    """A fenced write in a transaction of its own; ``False`` when the lease is not ours."""
    params = {**params, **_found_by(key)}
    async with borrowed(db) as (_, connection):
        with _waiting_for_key:
            cursor = await connection.execute(statement.by_ctid, params)
            row = await cursor.fetchone()
            if row is None:
                cursor = await connection.execute(statement.by_id, params)
                row = await cursor.fetchone()
    return row is not None
