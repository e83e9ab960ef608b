"""The tables recoverypoint owns, as SQLAlchemy Core metadata.

The Alembic revisions under ``migrations/`` create exactly these tables; a test compares
the two so they cannot drift apart.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, BYTEA, JSONB, UUID

metadata = MetaData()

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    # The tenant, and the column the table is distributed by on Citus (partitioned by, in
    # tests): in every key and unique constraint (migration 0011).
    Column("scope", Text, nullable=False),
    Column("operation", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("operation_version", Integer, nullable=False),
    Column("request_method", Text, nullable=False),
    Column("request_path", Text, nullable=False),
    Column("request_params", JSONB, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("recovery_point", Text, nullable=False, server_default=text("'started'")),
    Column("state", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # The lease: whoever holds lock_token may commit until locked_at + the lock timeout.
    Column("locked_at", DateTime(timezone=True)),
    Column("lock_token", UUID(as_uuid=True)),
    # The lock timeout, in seconds, of the request holding the lease (written by every
    # claim): an operator's tool judges the lease by it without knowing the operation.
    # None on a row claimed before migration 0010: such a lease is judged by the
    # operation when it is known, and is live when it is not.
    Column("lock_timeout", Double),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column(
        "next_attempt_at", DateTime(timezone=True), nullable=False, server_default=text("now()")
    ),
    Column("last_error", Text),
    Column("response_status", Integer),
    Column("response_headers", JSONB),
    Column("response_body", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("last_run_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    # When an operator last made the key due (keys retry, migration 0016): a key retried
    # since its last run is the completer's at once, whatever its min_age.
    Column("retried_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    # Set when the completer gives the key up after its last attempt (see workers.completer).
    Column("abandoned_at", DateTime(timezone=True)),
    # What every key derived for the row is made from (recoverypoint.keys.key_seed): a
    # function of the request and the database's namespace, so that a row lost in a
    # failover is claimed again with the same one. NULL in rows claimed before migration
    # 0009, which derive from their id and creation time.
    Column("derivation_seed", Text),
    # How many times (scope, operation, key) was used and deleted after its retention
    # before this request (migration 0013): part of what its derived keys are made from, so
    # that a reuse gets new ones and a row lost in a failover the same ones.
    Column("generation", Integer, nullable=False, server_default=text("0")),
    # When the recovery point was committed: the earliest the step after it was first
    # called, which its provider's dedupe window counts from. NULL before migration 0013.
    Column("point_reached_at", DateTime(timezone=True)),
    # Times the step after the recovery point was called anew with a fresh downstream key,
    # its provider having forgotten the old one; 0 again when the point moves on.
    Column("window_renewals", Integer, nullable=False, server_default=text("0")),
    # Set while the key waits for an operator's reconciliation (the step after its point
    # is past its provider's window, with no reconcile hook); no worker takes it.
    Column("reconcile_since", DateTime(timezone=True)),
    # When the operation's compensation committed for the abandoned key (it runs once).
    Column("compensated_at", DateTime(timezone=True)),
    # When the completer may next run the abandoned key's compensation, if its operation
    # declares one: set by every abandonment, pushed back by a failed compensation, NULL
    # once it commits, once the key is reopened, and on keys abandoned before migration 0013.
    Column("compensation_due_at", DateTime(timezone=True)),
    # How many times the compensation raised: its back-off grows with it.
    Column("compensation_attempts", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("id", "scope", name="idempotency_keys_pkey"),
    # The client's key first: the claim names all three columns, a search by the key alone
    # (the console's, a support ticket's) only the first.
    UniqueConstraint(
        "idempotency_key", "scope", "operation", name="idempotency_keys_scope_operation_key"
    ),
    # No CHECK constraint: PostgreSQL compiles a table's CHECK constraints again for every
    # statement that writes a row of it (migrations 0008 and 0017). The engine refuses a key
    # or scope outside its lengths before its claim, the only statement that inserts a key
    # row. A finished key always has its response, and an abandoned key is finished (it
    # carries the error response a retry replays): every statement that sets those columns
    # sets them together, and doctor counts the rows that break the rules
    # (recoverypoint.admin.keys.BROKEN).
    # The completer's claim: unfinished keys by the time their next attempt is due.
    Index(
        "idempotency_keys_unfinished",
        "next_attempt_at",
        postgresql_where=text("finished_at IS NULL"),
    ),
    # The reaper's scan: finished keys by age.
    Index(
        "idempotency_keys_finished_at",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
    ),
    # The metrics collector's count of abandoned keys, read at every scrape.
    Index(
        "idempotency_keys_abandoned",
        "operation",
        postgresql_where=text("abandoned_at IS NOT NULL"),
    ),
    # The completer's search for compensations due: only the keys awaiting one, not every
    # abandoned key; by operation first, so that the keys of operations declaring none
    # (due too: whoever abandons a key need not know its operation) are never read.
    Index(
        "idempotency_keys_compensation_due",
        "operation",
        "operation_version",
        "compensation_due_at",
        postgresql_where=text("compensation_due_at IS NOT NULL"),
    ),
)

staged_jobs = Table(
    "staged_jobs",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("job_name", Text, nullable=False),
    Column("job_args", JSONB, nullable=False),
    # Derived from the key record and the job's position in it: stable across retries,
    # so a consumer can dedupe on it. Unique by construction (the phase that stages it
    # commits once per key); not indexed, as nothing looks a job up by it (migration 0008).
    Column("job_key", Text, nullable=False),
    # The key record that staged the job. Deliberately not a foreign key: under
    # SERIALIZABLE, the check of one would lock the primary-key index page that every new
    # key is inserted into, and concurrent requests would abort each other (40001). The
    # reaper sets it to NULL when it deletes the key, as ON DELETE SET NULL would.
    Column("idempotency_key_id", BigInteger),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    # A job whose publish failed stays staged and waits until next_attempt_at.
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column(
        "next_attempt_at", DateTime(timezone=True), nullable=False, server_default=text("now()")
    ),
    Column("last_error", Text),
    # The W3C traceparent of the phase that staged the job, when the engine traces.
    Column("trace_context", Text),
    # The scope of the key that staged the job: co-located with it on Citus ('' for a job
    # staged before migration 0011 whose key was gone by then).
    Column("scope", Text, nullable=False),
    PrimaryKeyConstraint("id", "scope", name="staged_jobs_pkey"),
    Index("staged_jobs_idempotency_key_id", "idempotency_key_id"),
    # The enqueuer's claim: due jobs, oldest first.
    Index("staged_jobs_next_attempt_at", "next_attempt_at"),
)

# What the consume-once helper (recoverypoint.jobs.consume_once) records: one row per
# consumer and message, written in the consumer's own transaction; the reaper prunes it.
processed_messages = Table(
    "processed_messages",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("message_id", Text, nullable=False),
    Column("processed_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    # The scope of the job processed (migration 0014), as its consumer passed it; '' when it
    # passes none. The column the table is distributed by on Citus, co-located with the
    # keys, so that a consumer's record commits on its scope's worker.
    Column("scope", Text, nullable=False, server_default=text("''")),
    # On one server; recoverypoint.distribute puts the scope into it on Citus.
    PrimaryKeyConstraint("consumer", "message_id", name="processed_messages_pkey"),
    Index("processed_messages_processed_at", "processed_at"),
    # The reaper's batches, one scope at a time.
    Index("processed_messages_scope_processed_at", "scope", "processed_at"),
)

# The next generation of each key whose finished row was deleted (by the reaper, or by the
# claim of a reuse past its retention), written in the transaction that deletes the row: a
# reuse after reaping is a new generation too (recoverypoint.keys.key_seed). Pruned by the
# reaper after the generations' retention.
key_generations = Table(
    "key_generations",
    metadata,
    Column("scope", Text, nullable=False),
    Column("operation", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("deleted_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    PrimaryKeyConstraint("idempotency_key", "scope", "operation", name="key_generations_pkey"),
    Index("key_generations_deleted_at", "deleted_at"),
)

# When each kind of worker last ran a pass, per host (workers.loop); `recoverypoint doctor`
# reads it.
worker_passes = Table(
    "worker_passes",
    metadata,
    Column("worker", Text, primary_key=True),
    Column("host", Text, primary_key=True),
    Column("pid", Integer, nullable=False),
    Column("last_pass_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("last_error", Text),
    # Seconds between the worker's passes (migration 0012); None for a single pass.
    Column("interval_seconds", Double),
)

# What each running completer can finish: the operation versions its application registers,
# written with each of its passes (one row per completer, recoverypoint.running), so that a
# worker, `recoverypoint doctor` and the console tell the keys no running completer can
# finish from those another one will. Rows of completers no longer running are deleted by
# the next one that records.
completer_operations = Table(
    "completer_operations",
    metadata,
    Column("completer", UUID(as_uuid=True), primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("operations", ARRAY(Text), nullable=False),
    # versions[i] is the version of operations[i] that it registers.
    Column("versions", ARRAY(Integer), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    # Seconds until its next pass at the latest; None for a single pass (--once).
    Column("interval_seconds", Double),
)

# One row: the namespace of this database's derived keys (recoverypoint.keys.key_seed),
# made at random by migration 0009 and replicated with the database.
recoverypoint_namespace = Table(
    "recoverypoint_namespace",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("namespace", Text, nullable=False),
    CheckConstraint("one", name="recoverypoint_namespace_one_row"),
)

# One row per operator action (recoverypoint.admin, so the CLI and the console alike),
# written in the action's own transaction: who, through what, did what, to which rows.
audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("actor", Text, nullable=False),
    Column("via", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("matched", Integer, nullable=False),
    # The rows the action changed (keys, or staged jobs for jobs.*); those it selected
    # but left alone are only counted.
    Column("ids", ARRAY(BigInteger), nullable=False),
    Column("details", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
)

# Secrets made once per database by migration 0010: ``mask`` keys the digests of masked
# values (recoverypoint.admin.mask), so that nobody without it can brute-force them back.
installation_secrets = Table(
    "installation_secrets",
    metadata,
    Column("name", Text, primary_key=True),
    Column("secret", BYTEA, nullable=False),
)
