"""Every statement of the request path, named after its intent, in psycopg's named
placeholders (``%(name)s``; a :class:`Statement` also carries libpq's numbered form).
:mod:`recoverypoint.engine.store` and :mod:`recoverypoint.engine.store_async` run them;
:mod:`recoverypoint.engine._pg` and :mod:`recoverypoint.engine._pg_async` begin and end the
transactions they run in.

Every write after the claim is fenced by the lease's ``lock_token`` and checked by row
count (the write that records a phase raises when it finds no row, so the COMMIT sent with
it never runs), so a request that lost its lease can never commit. Three things keep them
cheap:

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
  the phase's staged jobs in the same statement (where Citus distributes the keys, as
  statements of their own: :attr:`Fenced.bound`). A miss means the phase itself changed the
  key row or ended the transaction: the statement raises (:data:`KEY_ROW_CHANGED`,
  :data:`TRANSACTION_ENDED`) and nothing commits. (Where the write is the fence of a phase
  that sends nothing, a miss may also be a stale address or a lost lease, which the engine
  then tells apart: ``recoverypoint.engine.store.fence_later``.)
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import NamedTuple

from .. import backoff, generations, leases

# The transaction of every claim and atomic phase; sent by the transaction layer itself.
BEGIN = b"BEGIN ISOLATION LEVEL SERIALIZABLE"

# The transaction's token, a setting local to it (see :func:`mark`): the write that records
# a phase runs only where it still holds the token its transaction began with.
TOKEN = "recoverypoint.tx"


def mark(token: str) -> bytes:
    """The statement that gives the transaction just begun its ``token`` (the engine's own
    counter, never a client's input; checked here). Sent behind BEGIN, in the same round
    trip. A setting ``SET LOCAL`` makes ends with its transaction, so phase code that ends
    the engine's transaction and begins another leaves a transaction without it; unlike a
    transaction id, it is read on the server that runs the statement, which on Citus is the
    coordinator for BEGIN and for the write's condition alike. The engine's pipelines send
    :data:`MARK` instead where they prepare their statements, or leave the token to their
    first statement (:data:`MARKED`); this form goes where a
    statement is parsed with its execution (behind a pooler, and in the simple query that
    begins a transaction for phase code), as ``SET LOCAL`` rather than ``SELECT
    set_config(...)``: a utility statement is parsed but not planned, where an unnamed
    SELECT was planned anew in every transaction."""
    if not token.isdigit():
        raise ValueError(f"not a transaction token: {token!r}")
    return f"SET LOCAL {TOKEN} = '{token}'".encode()


# What the write that records a phase raises when it missed its row (see _GUARDED): the
# key row changed under the phase, or the phase ended the transaction it began in.
KEY_ROW_CHANGED = "RP001"
TRANSACTION_ENDED = "RP002"


class Statement:
    """A statement the engine sends often, in both of the forms it travels in: psycopg's
    named placeholders (``text``, for a cursor) and libpq's numbered ones (``positional``,
    prepared once per connection under ``name``, with the values in the order of
    ``names``). ``marks``: the statement gives its transaction the token itself (its
    ``%(tx)s``, see :data:`MARKED`), so that a pipeline it begins sends no :data:`MARK`."""

    def __init__(self, text: str, *, marks: bool = False) -> None:
        self.text = text
        self.marks = marks
        names: list[str] = []

        def numbered(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        self.positional = re.sub(r"%\((\w+)\)s", numbered, text).encode()
        self.names = tuple(names)
        digest = hashlib.sha256(self.positional).hexdigest()[:16]
        self.name = f"recoverypoint_{digest}".encode()

    def __repr__(self) -> str:
        return f"Statement({self.text!r})"


# BEGIN, the transaction's token (see :func:`mark`) and COMMIT as the pipelines send them
# where the engine prepares its statements (recoverypoint.engine._libpq): prepared once per
# connection, as every other statement of the engine's is. Sent unnamed, each was parsed
# and analyzed anew in every transaction, 4 % of a fresh request's server instructions.
BEGIN_STATEMENT = Statement(BEGIN.decode())
MARK = Statement(f"SELECT set_config('{TOKEN}', %(tx)s, true)")
COMMIT = Statement("COMMIT")
# The token given by the first statement of a transaction itself, as a column of its one row
# (a fresh key's claim, a phase's fence): a statement fewer for each, which cost a fresh
# request 46k client and 13k server instructions apiece (benchmarks/README.md, "The
# transaction's token in its first statement"). A statement that returns no row sets
# nothing, and the write that records a phase then misses (RP002); none of those rows is
# missing where such a write follows: a claim that inserted nothing runs no phase, and a
# fence that found no row raises LockLost. Not on Citus, where the token is read on the
# coordinator and a distributed statement's columns are computed on a worker.
MARKED = f"set_config('{TOKEN}', %(tx)s, true)"

# Begins the transaction a SQLAlchemy Connection of phase code then joins.
NOTHING = "SELECT 1"

# Every column as text, read one way whichever path it came by (a cursor, or libpq's own
# text results): see KeyRecord.parse. JSON is parsed where it is used, once; the creation
# time is the instant in UTC, so that no session's TimeZone or DateStyle changes it. The
# recovery point's age (seconds, on the database's clock: no process's clock judges a
# provider's dedupe window) is taken from the creation time in rows older than migration
# 0013, which is earlier still: a window is judged passed sooner, never later.
#
# Formatted outside the statement that writes the row where Citus distributes the keys: it
# refuses a function that is not IMMUTABLE (to_char) in a RETURNING clause, so the claim by
# id (CLAIM_BY_ID) returns the row's columns (_RETURNED) and formats them in the query around
# it. (A new key's claim returns its creation time as a number instead: see _CLAIMED.)
_RETURNED = """
    id, scope, idempotency_key, created_at, operation_version, fingerprint, recovery_point, state,
    request_params, response_status, response_headers, response_body, attempts,
    derivation_seed, generation, ctid, point_reached_at, window_renewals, reconcile_since
"""
_CREATED_AT = """to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US')"""
_RECORD_COLUMNS = f"""
    id::text, scope, idempotency_key, {_CREATED_AT},
    operation_version::text, fingerprint, recovery_point, state::text,
    request_params::text, response_status::text, response_headers::text,
    response_body::text, attempts::text, derivation_seed, generation::text,
    ctid::text AS ctid,
    extract(epoch FROM now() - coalesce(point_reached_at, created_at))::float8::text,
    window_renewals::text, (reconcile_since IS NOT NULL)::text
"""


# How long the lease has been held, in seconds; NULL when it is free. The caller judges it
# (leases.left) against the lock timeout of the version that started the key, which SQL
# does not know.
_HELD_FOR = f"{leases.HELD_FOR}::text"

# Every claim stores its lock timeout with the lease it takes (a column of the row it writes
# anyway), so that an operator's tool judges the lease as its holder does.
#
# Every claim that takes the lease counts the attempt it starts and schedules the next one
# (backoff.delay_sql), in the row it writes anyway: a process that dies mid-step has used
# its attempt, and the completer backs the key off rather than taking it again at once.
#
# Insert the key; when it exists, nothing, and the caller reads its row (CLAIMED_BEFORE) to
# tell a replay, a mismatch, a key in use and a key to resume apart (by the rules of the
# version that started it, which may not be the caller's). A new row returns only what its
# caller does not know: its id, address and creation time, and the params as jsonb stored
# them (see KeyRecord.new_row); the rest it wrote itself. (A statement that also read an
# existing row was a third of the server's work for a fresh key: every execution set up the
# second arm's scan and both arms' columns, for the rare request that needs them.) Under
# SERIALIZABLE a conflicting row this snapshot cannot see raises 40001, and the claim is
# retried with a fresh snapshot.
#
# A new row takes the key's generation (recoverypoint.generations): on one server, read by
# the INSERT itself, in the claim's transaction (after PAST_RETENTION, when it ran, recorded
# the next one). Where Citus distributes the keys, as FIND_FINISHED_BOUND read it just
# before the transaction: Citus refuses a sub-select in INSERT ... VALUES, and a check in
# this statement would cost a command to the worker per new key. Only a deletion of a row
# of the key created after that read can come in between: the reaper's and a reuse's need
# the row finished past its retention, which no row that young is; an operator's `keys
# delete --force` of the unfinished row can, and the row claimed next then derives the
# deleted one's keys (docs/concepts/downstream-keys.md says so). Either returns the
# generation it gave the row.
#
# The first attempt's back-off (its next_attempt_at) is computed by the caller
# (:func:`backoff.backoff_delay` of attempt 0): a row that does not exist yet counts no
# attempts to compute it from, and the expression cost the server about 1 % of a fresh
# request. The creation time comes back as seconds since the epoch (numeric, to the
# microsecond, in UTC): an IMMUTABLE expression, which Citus allows in a RETURNING clause
# where it refuses to_char, so that the claim is one INSERT there too (in a query around
# it, Citus ran the INSERT as a subplan through an intermediate result).
_CLAIM = """
    INSERT INTO idempotency_keys (
        scope, operation, idempotency_key, operation_version, request_method,
        request_path, request_params, fingerprint, derivation_seed, generation, locked_at,
        lock_token, lock_timeout, point_reached_at, attempts, next_attempt_at)
    VALUES (%(scope)s, %(operation)s, %(key)s, %(version)s, %(method)s,
        %(path)s, %(params)s::jsonb, %(fingerprint)s, %(seed)s, {generation}, now(),
        %(token)s, %(lock_timeout)s, now(), 1, now() + make_interval(secs => %(first_delay)s))
    ON CONFLICT (scope, operation, idempotency_key) DO NOTHING
"""
_RECORDED_GENERATION = """coalesce((
    SELECT g.generation FROM key_generations AS g
    WHERE g.scope = %(scope)s AND g.operation = %(operation)s
      AND g.idempotency_key = %(key)s), 0)"""
_CLAIMED = (
    " RETURNING id, extract(epoch FROM timezone('UTC', created_at)), ctid, request_params,"
    " generation"
)
CLAIM = Statement(
    _CLAIM.format(generation=_RECORDED_GENERATION) + _CLAIMED + f", {MARKED}", marks=True
)
CLAIM_BOUND = Statement(_CLAIM.format(generation="%(generation)s") + _CLAIMED)

# The row of a key CLAIM found there, read in the claim's transaction (the row it conflicted
# with, which its snapshot sees); nothing when it was deleted meanwhile (reaped).
CLAIMED_BEFORE = Statement(f"""
    SELECT {_RECORD_COLUMNS}, 'f' AS claimed, 'f' AS inserted, {_HELD_FOR}
    FROM idempotency_keys
    WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
""")

# Take an unfinished key by id when its lease is free, expired or already held under
# :token (the completer reserves keys in batches, then resumes each), when it has attempts
# left and does not wait for an operator's reconciliation; otherwise return the row so the
# caller can tell a replay, a key in use, a key held and a key out of attempts
# (ABANDON_EXHAUSTED) apart. The lease is checked in the UPDATE itself, so two callers
# never both get it.
CLAIM_BY_ID = Statement(f"""
    WITH claimed AS (
        UPDATE idempotency_keys AS k
        SET locked_at = now(), lock_token = %(token)s, lock_timeout = %(lock_timeout)s,
            last_run_at = now(), attempts = k.attempts + 1,
            next_attempt_at = {leases.from_now(backoff.delay_sql("k.attempts"))}
        WHERE k.scope = %(scope)s AND k.id = %(id)s AND k.finished_at IS NULL
          AND k.attempts < %(max_attempts)s AND k.reconcile_since IS NULL
          AND (k.lock_token = %(token)s OR {leases.free("%(lock_timeout)s")})
        RETURNING {_RETURNED}
    )
    SELECT {_RECORD_COLUMNS}, 't' AS claimed, 'f' AS inserted, NULL AS held_for FROM claimed
    UNION ALL
    SELECT {_RECORD_COLUMNS}, 'f', 'f', {_HELD_FOR}
    FROM idempotency_keys
    WHERE scope = %(scope)s AND id = %(id)s AND NOT EXISTS (SELECT 1 FROM claimed)
""")

# A key out of attempts whose lease is free (or :token's, a completer's reservation), and
# that waits for no operator's reconciliation: finished with the abandoned answer instead
# of another attempt, in the claim's transaction. Retries replay it; the reaper keeps it
# for the abandoned keys' retention; the completer runs its compensation, if declared and
# not already run (a key reopened after it: workers.compensator skips it).
ABANDON_EXHAUSTED = Statement(f"""
    UPDATE idempotency_keys AS k
    SET finished_at = now(), abandoned_at = now(),
        compensation_due_at = now(),
        response_status = %(status)s,
        response_headers = '{{}}'::jsonb, response_body = %(body)s::jsonb,
        locked_at = NULL, lock_token = NULL
    WHERE k.scope = %(scope)s AND k.id = %(id)s AND k.finished_at IS NULL
      AND k.attempts >= %(max_attempts)s AND k.reconcile_since IS NULL
      AND (k.lock_token = %(token)s OR {leases.free("%(lock_timeout)s")})
    RETURNING k.response_body::text
""")

# A finished key, read before any transaction: a replay needs nothing else. A finished
# row never changes until the reaper deletes it. Only what a replay reads (see
# Finished.parse): the request's params and the phases' state may be large. Then whether
# it is past the retention it is honoured for (see PAST_RETENTION), and the generation a
# new row of the key would take after it (recoverypoint.generations). No row when the key
# is not finished (or does not exist). Never through a cursor: libpq's text results are
# each column's text already, without a cast to compute.
_FINISHED_COLUMNS = """
    SELECT k.operation_version, k.fingerprint, k.response_status,
           k.response_headers, k.response_body,
           (k.abandoned_at IS NULL
            AND k.finished_at <= now() - make_interval(secs => %(retention)s)),
"""
_KEY_FINISHED = """
    k.scope = %(scope)s AND k.operation = %(operation)s AND k.idempotency_key = %(key)s
    AND k.finished_at IS NOT NULL
"""
FIND_FINISHED = Statement(f"""{_FINISHED_COLUMNS} k.generation + 1
    FROM idempotency_keys AS k WHERE {_KEY_FINISHED}
""")
# Where Citus distributes the keys, the generation a new row takes comes from here too (see
# CLAIM): the finished row's next when it is past its retention (PAST_RETENTION records
# it), else the recorded one, 0 when none. One row, whether or not the key exists; one
# shard (both tables are distributed by scope, co-located).
FIND_FINISHED_BOUND = Statement(f"""{_FINISHED_COLUMNS}
           coalesce(greatest(k.generation + 1, g.generation), 0)
    FROM (SELECT) AS lookup
    LEFT JOIN idempotency_keys AS k ON {_KEY_FINISHED}
    LEFT JOIN key_generations AS g
      ON g.scope = %(scope)s AND g.operation = %(operation)s AND g.idempotency_key = %(key)s
""")

# A key finished longer ago than the retention it is honoured for: a reuse of it is a new
# request, whether or not the reaper got to it. Deleted in the claim's transaction, before
# CLAIM inserts the new one; the condition is checked again here, under SERIALIZABLE. An
# abandoned key stays: it is a human's to look at, kept until the reaper's longer retention.
# Records the key's next generation, which the claim then gives the new row, as
# FIND_FINISHED(_BOUND) read it before the transaction (the row's, plus one: a finished row never
# changes; and when this finds the row gone, reaped meanwhile, the reaper recorded the same).
# From that value, so that on Citus the statement stays on the scope's shard
# (generations.record).
PAST_RETENTION = Statement(f"""
    WITH deleted AS (
        DELETE FROM idempotency_keys AS k
        WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
          AND finished_at <= now() - make_interval(secs => %(retention)s)
          AND abandoned_at IS NULL
        RETURNING 1
    ), {generations.record("%(scope)s", "%(operation)s", "%(key)s", "%(generation)s")}
    SELECT count(*) FROM deleted
""")

# The database's namespace of derived keys (migration 0009), read once per engine.
NAMESPACE = "SELECT namespace FROM recoverypoint_namespace"

# Which operation and version a key record belongs to, and its scope (Engine.resume looks
# it up by id): in its scope when the caller knows it (the completer), which reads one
# shard; by id alone otherwise, which reads every shard of a distributed table.
KEY_OPERATION = """
    SELECT operation, operation_version, scope FROM idempotency_keys
    WHERE scope = %(scope)s AND id = %(id)s
"""
KEY_OPERATION_ANY_SCOPE = """
    SELECT operation, operation_version, scope FROM idempotency_keys WHERE id = %(id)s
"""

# The fenced statements below end with {where}, written out when the module loads: by
# address first, by id when the address is stale; always in the key's scope, which routes
# each to the one shard (or partition) that holds the key. Each returns the row's new
# address, then what the statement names in ``returning``.
_BY_CTID = "scope = %(scope)s AND ctid = %(ctid)s::tid AND id = %(id)s AND lock_token = %(token)s"
_BY_ID = "scope = %(scope)s AND id = %(id)s AND lock_token = %(token)s"
# By ctid, and only in the phase's own transaction: phase code that ended it cannot have the
# point recorded in another (see :func:`mark`). current_setting() without a column: Citus
# evaluates it on the coordinator, where the transaction's token was set.
_IN_PHASE = f"current_setting('{TOKEN}', true) = %(tx)s AND {_BY_CTID}"


class Fenced(NamedTuple):
    """One fenced write, written out for each way of finding the row."""

    by_ctid: str
    by_id: str
    held: Statement
    """By ctid, in the transaction whose fence or claim locked the row (see :func:`mark`):
    the write that records an atomic phase, COMMIT right behind it. It raises when it misses
    its row (:data:`KEY_ROW_CHANGED`, :data:`TRANSACTION_ENDED`), so that COMMIT never
    runs."""
    bound: Statement
    """The same write where the keys are distributed (Citus), as one plain UPDATE or
    DELETE, which Citus sends to the key's worker as one command: it returns no row where
    :attr:`held` raises, and the engine then sends :data:`MISSED` instead of COMMIT."""
    sql: str
    """The UPDATE or DELETE, its ``{where}`` still to write (:meth:`staging`)."""
    returning: str
    wakes: bool
    """Whether it wakes the duplicates waiting for the key (:data:`_WAKE`)."""

    def staging(self, jobs: int) -> Statement:
        """:attr:`held`, inserting a phase's ``jobs`` staged jobs in the same statement."""
        return _staging(self, jobs)


# The phase's staged jobs, one row of VALUES each, all in the key's scope: a single-shard
# insert on Citus (an INSERT ... SELECT from unnest() is pulled to the coordinator and
# COPYed, which commits on every worker by two-phase commit). Not conditional on the write
# that records the phase: when that write misses its row the statement raises, and the
# jobs are never committed (where Citus distributes the keys they are sent only after the
# write found its row).
def _staged_values(n: int) -> str:
    return ", ".join(
        f"(%(scope)s, %(job_name_{i})s, %(job_args_{i})s::jsonb, %(job_key_{i})s, %(id)s, "
        f"%(job_trace_{i})s)"
        for i in range(n)
    )


# A NOTIFY on the key's channel (recoverypoint.engine.waits), for the duplicates that wait
# for it: sent by the write that finishes, releases or withdraws the key, so that it is heard
# exactly when that transaction commits, and never if it rolls back. Only when a duplicate
# waits: each holds the key's advisory lock shared while it does, so this write cannot take
# it (and PostgreSQL, which commits the transactions that notify one at a time, is spared
# the NOTIFY of every other key). A waiter that asks for the lock after this took it waits
# for the commit, then reads the key again. The lock and the channel are the run's
# (waits.wake: its key's, which the write's row is); the write runs only if it found the
# row. In a SELECT over the write's rows, not in its RETURNING, which Citus allows only
# immutable functions: the SELECT runs where the client's transaction is (the
# coordinator), where the waiters listen.
_WAKE = (
    "CASE WHEN pg_try_advisory_xact_lock(%(wake_lock)s::bigint) "
    "THEN NULL ELSE pg_notify(%(wake_channel)s, '')::text END"
)


def _write(sql: str, where: str, returning: str) -> str:
    columns = "ctid::text" + (f", {returning} AS returned" if returning else "")
    return f"{sql.format(where=where)} RETURNING {columns}"


def _written_out(sql: str, where: str, returning: str, wakes: bool) -> tuple[str, str]:
    """The write, found by ``where``, as the CTE ``written`` of its returned rows, and the
    CTE that comes before it."""
    write = _write(sql, where, returning)
    if not wakes:
        return "", f"written AS ({write})"
    names = "ctid" + (", returned" if returning else "")
    return f"woken AS ({write}), ", f"written AS (SELECT {names}, {_WAKE} FROM woken)"


def _alone(sql: str, where: str, returning: str, wakes: bool) -> str:
    if not wakes:
        return _write(sql, where, returning)
    before, written = _written_out(sql, where, returning, wakes)
    return f"WITH {before}{written} SELECT * FROM written"


def _guarded(sql: str, returning: str, wakes: bool, staged: str) -> Statement:
    before, written = _written_out(sql, _IN_PHASE, returning, wakes)
    nulls = ", ".join(["NULL"] * (1 + bool(returning) + wakes))
    # CASE, not AND: the miss is decided before the function is called, and told whether
    # the statement still runs in the phase's transaction.
    return Statement(f"""
        WITH {before}{written}{staged}
        SELECT * FROM written
        UNION ALL
        SELECT {nulls}
        WHERE CASE WHEN EXISTS (SELECT FROM written) THEN false
                   ELSE recoverypoint_write_missed(
                       current_setting('{TOKEN}', true) IS NOT DISTINCT FROM %(tx)s) END
    """)


def _insert_staged(jobs: int) -> str:
    return (
        "INSERT INTO staged_jobs (scope, job_name, job_args, job_key, idempotency_key_id, "
        f"trace_context) VALUES {_staged_values(jobs)}"
    )


@functools.lru_cache(maxsize=64)
def _staging(fenced: Fenced, jobs: int) -> Statement:
    return _guarded(
        fenced.sql, fenced.returning, fenced.wakes, f", staged AS ({_insert_staged(jobs)})"
    )


@functools.lru_cache(maxsize=64)
def staged_jobs(jobs: int) -> Statement:
    """A phase's ``jobs`` staged jobs on their own, where the keys are distributed: behind
    :attr:`Fenced.bound`, once it found its row."""
    return Statement(_insert_staged(jobs))


# Where the keys are distributed, the parts that :func:`_guarded` puts around the write are
# statements of their own: Citus runs each part of a statement that cannot go to one worker
# whole as a plan of its own, through intermediate results (3 subplans for the write that
# records a phase with its jobs, 4 with the wake-up; on a Citus node that held the keys
# itself, 3.5 ms of server time, against 2.0 for the UPDATE and the jobs' INSERT sent
# apart). The wake-up and the miss read no table: they run on the coordinator, where the
# waiters listen and where the transaction's token was set.
WAKE = Statement(f"SELECT {_WAKE}")
MISSED = Statement(
    f"SELECT recoverypoint_write_missed(current_setting('{TOKEN}', true) IS NOT DISTINCT FROM "
    "%(tx)s)"
)


def _by_ctid_and_by_id(sql: str, returning: str = "", *, wakes: bool = False) -> Fenced:
    return Fenced(
        _alone(sql, _BY_CTID, returning, wakes),
        _alone(sql, _BY_ID, returning, wakes),
        _guarded(sql, returning, wakes, ""),
        Statement(_write(sql, _IN_PHASE, returning)),
        sql,
        returning,
        wakes,
    )


# A phase stays on its scope's worker (Citus): its transaction exports a snapshot there, on
# the shard that holds the key row, in the statement that locks the row (the fence, bound),
# in the claim that inserted it (its trigger, recoverypoint.distribute.BINDS_NEW_KEY: a
# statement of its own after the claim cost a command to the worker), or right after a
# completer's fence of an abandoned key (BIND). Always before the phase's code runs: a
# savepoint that code rolls back stays open, and in it PostgreSQL refuses to export a
# snapshot. PostgreSQL refuses to PREPARE a transaction that exported a snapshot, so a
# phase that also writes on another worker (another scope's rows, a reference table, every
# shard), which Citus would commit by two-phase commit without SERIALIZABLE across the
# workers, fails at its COMMIT (LEFT_ITS_WORKER): that worker refuses the PREPARE and Citus
# rolls the others back, so nothing commits anywhere. A phase that stays on its worker
# commits with a plain COMMIT, which the export does not hinder. A SELECT, so Citus runs the
# function where the row is (it evaluates functions on the coordinator for writes only).
# Only where the keys are distributed (KEYS_DISTRIBUTED, asked where Citus is installed): on
# one server nothing is prepared, and the export would cost a file per phase for nothing.
_EXPORT = "pg_export_snapshot()"
BIND = Statement(f"SELECT {_EXPORT} FROM idempotency_keys WHERE scope = %(scope)s AND id = %(id)s")
LEFT_ITS_WORKER = "cannot PREPARE a transaction that has exported snapshots"
KEYS_DISTRIBUTED = """
    SELECT EXISTS (
        SELECT FROM pg_dist_partition
        WHERE logicalrelid = CAST('idempotency_keys' AS regclass) AND partmethod = 'h'
    )
"""

# Lock the row for the rest of the transaction, if the lease is still ours. The lease is
# renewed by the write that commits the phase: a renewal here would be seen by nobody
# (no other transaction sees it before that write replaces it) and would cost a row version.
# Bound to the scope's worker on Citus (see BIND). By address, prepared, in one pipeline with
# BEGIN (a round trip less for every phase after the first, and no planning per phase); by
# id when the address is stale.
#
# Beside the address, the fence gives its transaction the token on one server (MARKED), and
# exports the snapshot on Citus (bound).
_FENCE = """
    SELECT ctid::text, {also} FROM idempotency_keys WHERE {where}
    FOR UPDATE
"""
FENCE = Statement(_FENCE.format(also=MARKED, where=_BY_CTID), marks=True)
FENCE_BOUND = Statement(_FENCE.format(also=_EXPORT, where=_BY_CTID))
FENCE_BY_ID = _FENCE.format(also=MARKED, where=_BY_ID)
FENCE_BY_ID_BOUND = _FENCE.format(also=_EXPORT, where=_BY_ID)


# Commit a phase: the new recovery point and state, renewing the lease from this moment
# (statement_timestamp(), not now(): that is the transaction's start, and a phase that ran
# for longer than the lock timeout would leave its successor no lease at all; not
# clock_timestamp(), which Citus refuses in an UPDATE as VOLATILE). Only from the
# point the run started the phase at: a recovery point never moves backwards, even when a
# run records a step's result after the phase that followed it did commit (an ambiguous
# COMMIT failure). The new point's time starts the dedupe window of the foreign step after
# it, which is called after this commits: judged from here, a window passes early, never
# late; and that step has not been called anew yet.
ADVANCE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET recovery_point = %(point)s, state = %(state)s::jsonb,
        locked_at = statement_timestamp(), last_run_at = now(),
        point_reached_at = statement_timestamp(), window_renewals = 0
    WHERE recovery_point = %(from_point)s AND {where}
""",
    returning="state::text",
)

# Finish the key with its response and give the lease up. The state and the body come back
# as jsonb stored them (1e16 as an integer...), so that the first answer and every replay,
# a fresh run and a resumed one, see the same values.
FINISH = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET recovery_point = 'finished', state = %(state)s::jsonb,
        response_status = %(status)s, response_headers = %(headers)s::jsonb,
        response_body = %(body)s::jsonb, finished_at = now(),
        locked_at = NULL, lock_token = NULL, last_run_at = now()
    WHERE {where}
""",
    returning="response_body::text",
    wakes=True,
)

# A live holder's lease, renewed while its foreign step runs (recoverypoint.engine.heartbeat),
# in a statement of its own, outside any transaction of the run's: fenced by the token, so a
# lease released or taken over meanwhile stays so. It returns the row's new address, for the
# run's next fence. By id: it runs on its own (autocommit), where an address buys nothing.
RENEW = f"UPDATE idempotency_keys SET locked_at = now() WHERE {_BY_ID} RETURNING ctid::text"

# The heartbeat's own connection: a renewal waits for neither a lock nor a slow server
# longer than %(timeout)s (below a renewal interval), so that a failed one is retried in
# time. Local to the renewal's transaction (a pooler may hand the server connection on).
RENEWER_TIMEOUTS = (
    "SELECT set_config('statement_timeout', %(timeout)s, true), "
    "set_config('lock_timeout', %(timeout)s, true)"
)

# A failed attempt: give the lease up, keep the recovery point, record the error and back
# the key off from now. (Its claim counted the attempt.)
RELEASE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET locked_at = NULL, lock_token = NULL, last_error = %(error)s,
        next_attempt_at = now() + make_interval(secs => %(retry_in)s)
    WHERE {where}
""",
    wakes=True,
)

# A request withdrawn by its first phase (see operation.Withdrawn): forget the key, as long
# as nothing was recorded under it.
WITHDRAW = _by_ctid_and_by_id(
    "DELETE FROM idempotency_keys WHERE recovery_point = 'started' AND {where}", wakes=True
)


# The foreign step after the recovery point is about to be called anew, past its
# provider's dedupe window (its reconciliation found nothing): count the renewal, which
# gives the step a fresh downstream key, and start the window again, in a commit of its
# own before the call, so that a run that dies after it calls with that same fresh key.
# Only from the renewal the run read: two runs never renew twice for one call.
RENEW_WINDOW = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET window_renewals = window_renewals + 1, point_reached_at = statement_timestamp(),
        locked_at = statement_timestamp()
    WHERE recovery_point = %(point)s AND window_renewals = %(renewals)s AND {where}
""",
    returning="window_renewals",
)

# The foreign step after the recovery point is past its provider's dedupe window and
# nothing can ask the provider what its first call did: hold the key for an operator's
# reconciliation (``recoverypoint keys reconcile``). The lease is given up; no worker takes
# the key: the completer skips it, and its next attempt never comes, for a completer older
# than migration 0013's columns too (the last year Python's datetime holds, not 'infinity',
# which it cannot read). No claim takes it either. Not an attempt: nothing failed, and no
# step was called, so the attempt the claim counted is given back (never below 0: an
# operator's `keys retry --reset-attempts` may have zeroed the attempts since the claim).
HOLD = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET reconcile_since = now(), locked_at = NULL, lock_token = NULL,
        attempts = greatest(attempts - 1, 0),
        next_attempt_at = '9999-01-01 00:00:00+00', last_error = %(error)s
    WHERE {where}
""",
    wakes=True,
)

# The compensation of an abandoned key (Operation.compensation), which the completer claimed
# under ``token``: lock its row and read it, while it is still abandoned, not compensated,
# and the lease is the completer's (an operator's reopen, or a second completer whose lease
# took over an expired one, make it miss: nothing runs).
FENCE_ABANDONED = Statement(f"""
    SELECT {_RECORD_COLUMNS}, 't' AS claimed, 'f' AS inserted, NULL AS held_for
    FROM idempotency_keys
    WHERE scope = %(scope)s AND id = %(id)s AND lock_token = %(token)s
      AND abandoned_at IS NOT NULL AND compensated_at IS NULL
    FOR UPDATE
""")

# The compensation committed: recorded once, with the state it left, no longer due, and
# the lease given up. The stored (abandoned) response stays as it is.
COMPENSATE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET compensated_at = now(), compensation_due_at = NULL, state = %(state)s::jsonb,
        locked_at = NULL, lock_token = NULL
    WHERE abandoned_at IS NOT NULL AND compensated_at IS NULL AND {where}
""",
    returning="id",
)
