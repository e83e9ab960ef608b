"""Every statement of the request path and every worker's claim reads one partition, on
tables partitioned by scope as Citus distributes them (tests/partitioned.py): with a
concrete scope, ``EXPLAIN`` names one partition of ``idempotency_keys`` and of
``staged_jobs``, the same one (the scope's), so on Citus each runs on the scope's worker.

A statement that names no scope reads every partition: the control below shows that the
check can fail.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from partitioned import PARTITIONS, partition_by_scope, partitions_read
from sqlalchemy.pool import NullPool

from recoverypoint import leases, migrate
from recoverypoint.admin import key_actions
from recoverypoint.database import create_engine
from recoverypoint.engine import sql
from recoverypoint.testing import temporary_database
from recoverypoint.workers import compensator, completer, enqueuer, reaper

SCOPE = "tenant-42"

_KEY = {
    "scope": SCOPE,
    "operation": "op",
    "key": "k",
    "version": 1,
    "method": "POST",
    "path": "/p",
    "params": "{}",
    "fingerprint": "f",
    "seed": "s",
    "generation": 0,
    "token": uuid.uuid4(),
    "lock_timeout": 90.0,
    "max_attempts": 3,
    "retry_base": 2.0,
    "retry_cap": 3600.0,
    "jitter": 0.5,
    "retention": 3600.0,
    "id": 7,
    "ctid": "(0,1)",
    "tx": "1",
    "first_delay": 1.0,
    "wake_lock": 7,
    "wake_channel": "recoverypoint_0",
}
_PHASE = {
    "point": "b",
    "from_point": "a",
    "state": "{}",
    "status": 201,
    "headers": "{}",
    "body": "{}",
    "error": "e",
    "retry_in": 1.0,
}
_JOBS = {
    f"{column}_{i}": value
    for i in range(2)
    for column, value in (
        ("job_name", "j"),
        ("job_args", "{}"),
        ("job_key", "k"),
        ("job_trace", None),
    )
}


def _fenced() -> Iterator[tuple[str, str]]:
    for name in ("ADVANCE", "FINISH", "RELEASE", "WITHDRAW"):
        fenced: sql.Fenced = getattr(sql, name)
        yield f"{name} by ctid", fenced.by_ctid
        yield f"{name} by id", fenced.by_id
        yield f"{name} held", fenced.held.text
        yield f"{name} held, staging 2 jobs", fenced.staging(2).text
        # Where Citus distributes the keys; the jobs then follow in an INSERT of their own,
        # whose rows land in the scope's partition by their value, as CLAIM's does.
        yield f"{name} bound", fenced.bound.text


REQUEST_PATH = [
    ("FIND_FINISHED", sql.FIND_FINISHED.text),
    ("FIND_FINISHED_BOUND", sql.FIND_FINISHED_BOUND.text),
    ("PAST_RETENTION", sql.PAST_RETENTION.text),
    # CLAIM inserts its one row, which lands in its scope's partition by its value, and reads
    # the key's recorded generation, by the scope (CLAIM_BOUND takes it as a value). What it
    # reads when the key exists, it reads with CLAIMED_BEFORE.
    ("CLAIMED_BEFORE", sql.CLAIMED_BEFORE.text),
    ("CLAIM_BY_ID", sql.CLAIM_BY_ID.text),
    ("ABANDON_EXHAUSTED", sql.ABANDON_EXHAUSTED.text),
    ("KEY_OPERATION", sql.KEY_OPERATION),
    ("FENCE_BY_ID", sql.FENCE_BY_ID),
    ("FENCE_BY_ID_BOUND", sql.FENCE_BY_ID_BOUND),
    ("FENCE", sql.FENCE.text),
    ("FENCE_BOUND", sql.FENCE_BOUND.text),
    ("BIND", sql.BIND.text),
    *_fenced(),
]

# The workers' claims and their writes after the claim, in one scope each (SQLAlchemy's
# :name placeholders).
_REGISTERED = leases.registered([])
WORKER_CLAIMS = [
    (
        "completer",
        completer._CLAIM_IN_SCOPE,
        {**_REGISTERED, "min_age": 0, "batch_size": 10, "reservation": 30.0},
    ),
    ("completer's release", completer._RELEASE_UNSTARTED, {"ids": [1, 2]}),
    (
        "completer's abandonment",
        key_actions._ABANDON_EXHAUSTED,
        {"id": 1, "max_attempts": 3, "status": 500, "body": "{}"},
    ),
    ("compensator", compensator._CLAIM, {**_REGISTERED, "batch_size": 10}),
    (
        "compensator's failure",
        compensator._FAILED,
        {"id": 1, "error": "e", "retry_in": 1.0},
    ),
    ("enqueuer's delete", enqueuer._DELETE_PUBLISHED_IN_SCOPE, {"ids": [1, 2]}),
    ("enqueuer's postponement", enqueuer._POSTPONE, {"id": 1, "error": "e", "retry_in": 1.0}),
    ("enqueuer", enqueuer._CLAIM_IN_SCOPE, {"batch_size": 10}),
    (
        "reaper",
        reaper._KEYS.in_scope,
        {
            "operations": [],
            "versions": [],
            "retentions": [],
            "shortest": 1.0,
            "retention": 1.0,
            "abandoned_retention": 1.0,
            "compensating_operations": ["op"],
            "compensating_versions": [1],
            "batch_size": 10,
        },
    ),
    ("reaper's pruning", reaper._GENERATIONS.in_scope, {"retention": 1.0, "batch_size": 10}),
    (
        "reaper's consume-once records",
        reaper._MESSAGES.in_scope,
        {"retention": 1.0, "batch_size": 10},
    ),
    (
        "operator's delete",
        key_actions._DELETE,
        {"ids": [1], "tokens": [None], "free_before": [None], "force": False},
    ),
    (
        "operator's purge",
        key_actions._PURGE_BATCH,
        {"older_than": 1.0, "abandoned": False, "batch_size": 10},
    ),
]


@pytest.fixture(scope="module")
def partitioned(server_url: str) -> Iterator[sa.Engine]:
    """A migrated database of this module, its two tables partitioned by scope."""
    with temporary_database(server_url) as url:
        migrate.upgrade(url)
        db = create_engine(url, poolclass=NullPool)
        try:
            partition_by_scope(db)
            yield db
        finally:
            db.dispose()


def _plan(db: sa.Engine, statement: str, params: dict[str, Any]) -> str:
    """The plan of one of the engine's statements (psycopg's placeholders), with ``params``
    bound at the server as the engine binds them."""
    with db.connect() as conn:
        cursor = conn.connection.driver_connection.execute(f"EXPLAIN {statement}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize(("name", "statement"), REQUEST_PATH, ids=[n for n, _ in REQUEST_PATH])
@pytest.mark.slow
def test_every_request_path_statement_reads_the_scopes_partition_alone(
    partitioned: sa.Engine, name: str, statement: str
) -> None:
    plan = _plan(partitioned, statement, {**_KEY, **_PHASE, **_JOBS})
    assert len(partitions_read(plan)) == 1, f"{name} reads more than one partition:\n{plan}"


@pytest.mark.parametrize(
    ("name", "statement", "params"), WORKER_CLAIMS, ids=[n for n, _, _ in WORKER_CLAIMS]
)
def test_every_workers_claim_reads_one_scopes_partition_alone(
    partitioned: sa.Engine, name: str, statement: sa.TextClause, params: dict[str, Any]
) -> None:
    compiled = str(statement.compile(partitioned))  # psycopg's placeholders
    plan = _plan(partitioned, compiled, {"scope": SCOPE, "token": uuid.uuid4(), **params})
    assert len(partitions_read(plan)) == 1, f"the {name}'s claim reads more than one:\n{plan}"


def test_a_statement_without_the_scope_reads_every_partition(partitioned: sa.Engine) -> None:
    plan = _plan(partitioned, sql.KEY_OPERATION_ANY_SCOPE, {"id": 7})
    assert len(partitions_read(plan)) == PARTITIONS
