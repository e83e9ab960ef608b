"""Which errors the engine runs its transaction again for (recoverypoint.engine.conflicts):
PostgreSQL's 40001 and 40P01, and Citus's XX000 whose message is a relayed serialization
failure, a worker's failed COMMIT or a deadlock; nothing else."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from recoverypoint.engine.conflicts import is_conflict, retryable

# As Citus 13.2 reports them (an insert's COPY on a worker, a worker's COMMIT, a worker's
# deadlock), and as PostgreSQL writes the serialization failures it relays.
CITUS_RETRYABLE = [
    "could not serialize access due to read/write dependencies among transactions",
    "could not serialize access due to concurrent update",
    "could not serialize access due to concurrent delete",
    "could not commit transaction for shard 102008 on at least one active node",
    "deadlock detected",
]

# XX000 that are real internal errors, and Citus's refusals: raised, never retried.
CITUS_NOT_RETRYABLE = [
    "could not commit transaction for shard on at least one active node",
    "could not serialize access due to read/write dependencies among transactions; and more",
    "cannot perform an INSERT with NULL in the partition column",
    "non-IMMUTABLE functions are not allowed in the RETURNING clause",
    "could not run distributed query with FOR UPDATE/SHARE commands",
    "functions used in UPDATE queries on distributed tables must not be VOLATILE",
    "cache lookup failed for relation 16384",
    "connection to the remote node localhost:9701 failed",
    "",
]


@pytest.mark.parametrize("message", CITUS_RETRYABLE)
def test_citus_relayed_conflicts_are_retried(message: str) -> None:
    assert retryable("XX000", message)


@pytest.mark.parametrize("message", CITUS_NOT_RETRYABLE)
def test_other_internal_errors_are_not(message: str) -> None:
    assert not retryable("XX000", message)


@pytest.mark.parametrize("message", CITUS_RETRYABLE)
def test_the_words_alone_under_another_sqlstate_are_not(message: str) -> None:
    # A constraint's or a user's RAISE may say anything: only the internal error's code
    # makes these words Citus's.
    for state in ("P0001", "23505", "XX001", None):
        assert not retryable(state, message)


def test_postgresqls_own_codes_are_retried_whatever_the_message() -> None:
    assert retryable("40001", None)
    assert retryable("40P01", "anything")


@given(st.text(), st.sampled_from(["XX000", "40002", "P0001", None]))
def test_no_other_text_is_retried(message: str, state: str | None) -> None:
    # Odd text (NUL, any script, a known message with more around it) is never a conflict.
    for text in (message, CITUS_RETRYABLE[0] + message + "\n", message + "deadlock detected"):
        if text not in CITUS_RETRYABLE:
            assert not retryable(state, text)


@pytest.mark.slow
def test_a_real_serialization_failure_is_recognised_through_sqlalchemy_too(
    db: sa.Engine,
) -> None:
    # Raised by the server, read off the driver's error as the engine reads it.
    statement = (
        "DO $$ BEGIN RAISE EXCEPTION 'could not commit transaction for shard 7 on at least "
        "one active node' USING ERRCODE = 'XX000'; END $$"
    )
    with db.connect() as conn, pytest.raises(sa.exc.DBAPIError) as raised:
        conn.exec_driver_sql(statement)
    assert is_conflict(raised.value)
    assert isinstance(raised.value.orig, psycopg.errors.InternalError_)
    with db.connect() as conn, pytest.raises(sa.exc.DBAPIError) as other:
        conn.exec_driver_sql("DO $$ BEGIN RAISE EXCEPTION 'boom' USING ERRCODE = 'XX000'; END $$")
    assert not is_conflict(other.value)
