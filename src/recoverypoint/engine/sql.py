"""Every statement of the request path, named after its intent, in psycopg's named
placeholders (``%(name)s``; a :class:`Statement` also carries libpq's numbered form).
:mod:`recoverypoint.store` and :mod:`recoverypoint.store_async` run them;
:mod:`recoverypoint._pg` and :mod:`recoverypoint._pg_async` begin and end the transactions
they run in.

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
  the phase's staged jobs in the same statement. A miss means the phase itself changed the
  key row or ended the transaction: the statement raises (:data:`KEY_ROW_CHANGED`,
  :data:`TRANSACTION_ENDED`) and nothing commits.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple
from uuid import UUID

# The transaction of every claim and atomic phase; sent by the transaction layer itself.
BEGIN = b"BEGIN ISOLATION LEVEL SERIALIZABLE"

# What the write that records a phase raises when it missed its row (see _GUARDED): the
# key row changed under the phase, or the phase ended the transaction it began in.
KEY_ROW_CHANGED = "RP001"
TRANSACTION_ENDED = "RP002"


class Statement:
    """A statement the engine sends often, in both of the forms it travels in: psycopg's
    named placeholders (``text``, for a cursor) and libpq's numbered ones (``positional``,
    prepared once per connection under ``name``, with the values in the order of
    ``names``)."""

    def __init__(self, text: str) -> None:
        self.text = text
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


# Begins the transaction a SQLAlchemy Connection of phase code then joins.
NOTHING = "SELECT 1"

# Every column as text, read one way whichever path it came by (a cursor, or libpq's own
# text results): see KeyRecord.parse. JSON is parsed where it is used, once; the creation
# time is the instant in UTC, so that no session's TimeZone or DateStyle changes it.
_RECORD_COLUMNS = """
    id::text, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'),
    operation_version::text, fingerprint, recovery_point, state::text,
    request_params::text, response_status::text, response_headers::text,
    response_body::text, attempts::text, derivation_seed,
    ctid::text AS ctid, pg_current_xact_id_if_assigned()::text AS xid
"""


def lease_free(lock_timeout: str) -> str:
    """The rule, written once, for a lease anyone may take on key row ``k``: nobody holds it,
    or its holder has not renewed it for ``lock_timeout`` seconds (an SQL expression: the
    timeout of the version that started the key, which each caller finds its own way)."""
    return f"(k.locked_at IS NULL OR k.locked_at <= now() - make_interval(secs => {lock_timeout}))"


# How long the lease has been held, in seconds; NULL when it is free. The caller judges it
# against the lock timeout of the version that started the key, which SQL does not know.
_HELD_FOR = "extract(epoch FROM now() - locked_at)::float8::text"

# Every claim stores its lock timeout with the lease it takes (a column of the row it writes
# anyway), so that an operator's tool judges the lease as its holder does.
#
# One round trip: insert the key, or, when it exists, return its row so the caller can tell
# a replay, a mismatch, a key in use and a key to resume apart (by the rules of the version
# that started it, which may not be the caller's). An existing row is read,
# not locked: a replay writes nothing, so its transaction commits without a WAL flush; a
# key to resume is then taken with CLAIM_BY_ID. Under SERIALIZABLE a conflicting row this
# snapshot cannot see raises 40001, and the claim is retried with a fresh snapshot.
CLAIM = Statement(f"""
    WITH claimed AS (
        INSERT INTO idempotency_keys (
            scope, operation, idempotency_key, operation_version, request_method,
            request_path, request_params, fingerprint, derivation_seed, locked_at, lock_token,
            lock_timeout)
        VALUES (%(scope)s, %(operation)s, %(key)s, %(version)s, %(method)s,
            %(path)s, %(params)s::jsonb, %(fingerprint)s, %(seed)s, now(), %(token)s,
            %(lock_timeout)s)
        ON CONFLICT (scope, operation, idempotency_key) DO NOTHING
        RETURNING {_RECORD_COLUMNS}, 't' AS claimed, 't' AS inserted, NULL AS held_for
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT {_RECORD_COLUMNS}, 'f', 'f', {_HELD_FOR}
    FROM idempotency_keys
    WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
      AND NOT EXISTS (SELECT 1 FROM claimed)
""")

# Take an unfinished key by id when its lease is free, expired or already held under
# :token (the completer claims keys in batches, then resumes each); otherwise return the
# row so the caller can tell a replay from a key in use. The lease is checked in the
# UPDATE itself, so two callers never both get it.
CLAIM_BY_ID = Statement(f"""
    WITH claimed AS (
        UPDATE idempotency_keys AS k
        SET locked_at = now(), lock_token = %(token)s, lock_timeout = %(lock_timeout)s,
            last_run_at = now()
        WHERE k.id = %(id)s AND k.finished_at IS NULL
          AND (k.lock_token = %(token)s OR {lease_free("%(lock_timeout)s")})
        RETURNING {_RECORD_COLUMNS}, 't' AS claimed, 'f' AS inserted, NULL AS held_for
    )
    SELECT * FROM claimed
    UNION ALL
    SELECT {_RECORD_COLUMNS}, 'f', 'f', {_HELD_FOR}
    FROM idempotency_keys
    WHERE id = %(id)s AND NOT EXISTS (SELECT 1 FROM claimed)
""")

# A finished key, read before any transaction: a replay needs nothing else. A finished
# row never changes until the reaper deletes it. Only what a replay reads (see
# Finished.parse): the request's params and the phases' state may be large.
FINISHED = Statement("""
    SELECT operation_version::text, fingerprint, response_status::text,
           response_headers::text, response_body::text
    FROM idempotency_keys
    WHERE scope = %(scope)s AND operation = %(operation)s AND idempotency_key = %(key)s
      AND finished_at IS NOT NULL
""")

# The database's namespace of derived keys (migration 0009), read once per engine.
NAMESPACE = "SELECT namespace FROM recoverypoint_namespace"

# Which operation and version a key record belongs to (Engine.resume looks it up by id).
KEY_OPERATION = "SELECT operation, operation_version FROM idempotency_keys WHERE id = %(id)s"

# The fenced statements below end with {where}, written out when the module loads: by
# address first, by id when the address is stale. Each returns the row's new address and
# the transaction it ran in (which must be the phase's own, see phase_guard), then what
# the statement names in ``returning``.
_BY_CTID = "ctid = %(ctid)s::tid AND id = %(id)s AND lock_token = %(token)s"
_BY_ID = "id = %(id)s AND lock_token = %(token)s"


class Fenced(NamedTuple):
    """One fenced write, written out for each way of finding the row."""

    by_ctid: str
    by_id: str
    held: Statement
    """By ctid, in the transaction whose fence or claim locked the row (see ``xid``): the
    write that records an atomic phase, COMMIT right behind it. It raises when it misses its
    row (:data:`KEY_ROW_CHANGED`, :data:`TRANSACTION_ENDED`), so that COMMIT never runs."""
    held_staging: Statement
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


def _by_ctid_and_by_id(sql: str, returning: str = "") -> Fenced:
    def written_out(where: str) -> str:
        return f"{sql.format(where=where)} RETURNING ctid::text, pg_current_xact_id()::text" + (
            f", {returning}" if returning else ""
        )

    # Also in the phase's own transaction: phase code that ended it cannot have the point
    # recorded in another.
    held = written_out(f"pg_current_xact_id()::text = %(xid)s AND {_BY_CTID}")
    nulls = ", ".join(["NULL"] * (2 + bool(returning)))

    def guarded(staged: str) -> Statement:
        # CASE, not AND: the miss is decided before the function is called.
        return Statement(f"""
            WITH written AS ({held}){staged}
            SELECT * FROM written
            UNION ALL
            SELECT {nulls}
            WHERE CASE WHEN EXISTS (SELECT FROM written) THEN false
                       ELSE recoverypoint_write_missed(%(xid)s) END
        """)

    return Fenced(
        written_out(_BY_CTID), written_out(_BY_ID), guarded(""), guarded(f", staged AS ({_STAGED})")
    )


# Lock the row for the rest of the transaction, if the lease is still ours. The lease is
# renewed by the write that commits the phase: a renewal here would be seen by nobody
# (no other transaction sees it before that write replaces it) and would cost a row version.
_FENCE = """
    SELECT ctid::text, pg_current_xact_id()::text FROM idempotency_keys WHERE {where}
    FOR UPDATE
"""
FENCE_BY_ID = _FENCE.format(where=_BY_ID)
_CTID = re.compile(r"\(\d+,\d+\)")


def fence_by_ctid(ctid: str, key_id: int, token: UUID) -> str:
    """The fence by address, its values written into the text, so that it travels with
    BEGIN in one message (:meth:`recoverypoint._pg.Transaction.begin_with`): a round trip
    less for every phase after the first. Only values whose form is checked here go in:
    never a client's input."""
    if _CTID.fullmatch(ctid) is None or type(key_id) is not int or type(token) is not UUID:
        raise ValueError(f"not a key row's address: {ctid!r}, {key_id!r}, {token!r}")
    where = f"ctid = '{ctid}'::tid AND id = {key_id} AND lock_token = '{token}'"
    return _FENCE.format(where=where)


# Commit a phase: the new recovery point and state, renewing the lease from this moment
# (clock_timestamp(), not now(): that is the transaction's start, and a phase that ran for
# longer than the lock timeout would leave its successor no lease at all). Only from the
# point the run started the phase at: a recovery point never moves backwards, even when a
# run records a step's result after the phase that followed it did commit (an ambiguous
# COMMIT failure).
ADVANCE = _by_ctid_and_by_id(
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
)

# A failed attempt: give the lease up, keep the recovery point, count and record it.
RELEASE = _by_ctid_and_by_id(
    """
    UPDATE idempotency_keys
    SET locked_at = NULL, lock_token = NULL, attempts = attempts + 1, last_error = %(error)s,
        next_attempt_at = now() + make_interval(secs => %(retry_in)s)
    WHERE {where}
"""
)

# A request withdrawn by its first phase (see operation.Withdrawn): forget the key, as long
# as nothing was recorded under it.
WITHDRAW = _by_ctid_and_by_id(
    "DELETE FROM idempotency_keys WHERE recovery_point = 'started' AND {where}"
)
