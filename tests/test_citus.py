"""The request path and the workers on Citus: a coordinator named by
``RECOVERYPOINT_CITUS_URL`` (its workers added), migrated and distributed here with
``recoverypoint migrate --citus`` (idempotent, so a cluster can be reused).

Citus is in no package registry this project installs from, so these tests are skipped,
saying so, when the variable is not set; CI proves the shape on partitioned tables instead
(tests/test_partitioned.py and the layouts of tests/conftest.py). Every test works in
scopes of its own: Citus does not propagate CREATE DATABASE, so they share the database.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from test_demo_existing import RECOVERYPOINT_ROWS, demo, run_in_it_and_check_it_is_left_as_found

import recoverypoint as rp
from recoverypoint import admin, distribute
from recoverypoint.database import create_engine, normalize_url
from recoverypoint.jobs import InProcessBackend, Job, consume_once
from recoverypoint.workers import Completer, Enqueuer, Reaper

CITUS_URL_ENV = "RECOVERYPOINT_CITUS_URL"

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get(CITUS_URL_ENV),
        reason=(
            f"not run: no Citus coordinator ({CITUS_URL_ENV} is not set; Citus is in no "
            "registry this project installs from)"
        ),
    ),
    pytest.mark.slow,  # a Citus cluster's coordinator and workers
    # One test process: the tests share the cluster's tables, and one moves them.
    pytest.mark.xdist_group("citus"),
]

NOTES = """
CREATE TABLE IF NOT EXISTS citus_notes (
    scope text NOT NULL,
    key_id bigint NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (scope, key_id)
)
"""
# A reference table of the application's (no scope: copied to every node).
PLANS = "CREATE TABLE IF NOT EXISTS citus_plans (name text PRIMARY KEY)"
PLANS_REFERENCE = """
SELECT create_reference_table('citus_plans') WHERE NOT EXISTS (
    SELECT FROM pg_dist_partition WHERE logicalrelid = CAST('citus_plans' AS regclass))
"""


@pytest.fixture(scope="module")
def citus() -> Iterator[sa.Engine]:
    url = normalize_url(os.environ[CITUS_URL_ENV])
    db = create_engine(url, pool_size=5, max_overflow=10)
    with db.begin() as conn:
        conn.exec_driver_sql(NOTES)
        conn.exec_driver_sql(PLANS)
        conn.exec_driver_sql(PLANS_REFERENCE)
    plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
    migrated = subprocess.run(
        [sys.executable, "-m", "recoverypoint", "migrate", "--citus", "--colocate",
         "citus_notes", "--database-url", plain],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    yield db
    db.dispose()


@pytest.fixture
def scope() -> str:
    return f"tenant-{uuid.uuid4().hex[:12]}"


def _worker_of(db: sa.Engine, scope: str) -> str:
    """The worker that holds ``scope``'s shard."""
    with db.connect() as conn:
        return str(
            conn.execute(
                sa.text(
                    "SELECT nodename || ':' || nodeport FROM citus_shards WHERE shardid = "
                    "get_shard_id_for_distribution_column('idempotency_keys', CAST(:s AS text))"
                ),
                {"s": scope},
            ).scalar_one()
        )


@pytest.fixture
def other_scope(citus: sa.Engine, scope: str) -> str:
    """A scope whose shard is on another worker than ``scope``'s."""
    here = _worker_of(citus, scope)
    return next(
        other for n in itertools.count() if _worker_of(citus, other := f"{scope}-{n}") != here
    )


def _shard_of(db: sa.Engine, scope: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT get_shard_id_for_distribution_column("
                    "'idempotency_keys', CAST(:s AS text))"
                ),
                {"s": scope},
            ).scalar_one()
        )


@pytest.fixture
def neighbour_scope(citus: sa.Engine, scope: str) -> str:
    """A scope whose shard is another than ``scope``'s, on the same worker."""
    here, shard = _worker_of(citus, scope), _shard_of(citus, scope)
    return next(
        other
        for n in itertools.count()
        if _worker_of(citus, other := f"{scope}-n{n}") == here and _shard_of(citus, other) != shard
    )


@contextmanager
def _remote_commands(
    citus: sa.Engine, subplans: list[str] | None = None
) -> Iterator[tuple[sa.Engine, list[tuple[str, str]]]]:
    """An engine on the coordinator whose sessions log what Citus sends to its workers
    (``citus.log_remote_commands``: one notice per command, naming the worker), and the
    ``(command, worker)`` of each notice; in ``subplans``, if given, each part of a
    statement that Citus runs as a plan of its own, through an intermediate result."""
    sent: list[tuple[str, str]] = []
    options = "-c citus.log_remote_commands=on"
    if subplans is not None:
        options += " -c citus.log_intermediate_results=on -c client_min_messages=debug1"
    db = create_engine(citus.url, pool_size=1, connect_args={"options": options})

    def record(notice: Any) -> None:
        message, detail = notice.message_primary or "", notice.message_detail or ""
        if message.startswith("issuing "):
            sent.append((message.removeprefix("issuing "), detail.split(" connectionId")[0]))
        elif subplans is not None and message.startswith("generating subplan"):
            subplans.append(message)

    sa.event.listen(db, "connect", lambda dbapi_conn, _: dbapi_conn.add_notice_handler(record))
    try:
        yield db, sent
    finally:
        db.dispose()


def _prepared_on_workers(db: sa.Engine) -> int:
    """Transactions left prepared on the workers (a two-phase commit not finished)."""
    return _count(
        db,
        "SELECT coalesce(sum(result::int), 0) FROM run_command_on_workers("
        "'SELECT count(*) FROM pg_prepared_xacts')",
    )


def _notes(name: str, *, fail_once: list[bool] | None = None, **options: Any) -> rp.Operation[Any]:
    """note (a co-located row, two staged jobs) → a foreign step → finish (one more job)."""
    op: rp.Operation[Any] = rp.Operation(name, **options)

    @op.atomic_phase("noted")
    def note(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, %(b)s)",
            {"s": params["scope"], "k": tx.key_id, "b": params["body"]},
        )
        tx.stage_job("notify", {"n": 1})
        tx.stage_job("notify", {"n": 2})

    @op.foreign_step("called")
    def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        if fail_once:
            fail_once.clear()
            raise RuntimeError("the provider is down")
        return {"called_with": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.stage_job("notify", {"n": 3})
        return rp.Response(201, {"body": params["body"]})

    return op


def _count(db: sa.Engine, query: str, **params: Any) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(query), params).scalar_one())


def test_a_fresh_request_a_replay_and_a_reused_key(citus: sa.Engine, scope: str) -> None:
    op = _notes(f"citus_fresh_{uuid.uuid4().hex[:8]}")
    engine = rp.Engine(citus)
    engine.register(op)
    params = {"scope": scope, "body": "hello"}

    first = engine.run(op, key="k", params=params, scope=scope)
    again = engine.run(op, key="k", params=params, scope=scope)
    with pytest.raises(rp.ParamsMismatch):
        engine.run(op, key="k", params={**params, "body": "other"}, scope=scope)

    assert (first.status, first.replayed, again.status, again.replayed) == (201, False, 201, True)
    assert again.body == first.body
    notes = "SELECT count(*) FROM citus_notes WHERE scope = :s"
    assert _count(citus, notes, s=scope) == 1
    assert _count(citus, "SELECT count(*) FROM staged_jobs WHERE scope = :s", s=scope) == 3


def test_a_request_runs_on_its_scopes_worker_alone_without_two_phase_commit(
    citus: sa.Engine, scope: str
) -> None:
    """What Citus sends to its workers: a fresh request's commands all go to one worker and
    commit with a plain COMMIT; a replay is one command."""
    op = _notes(f"citus_remote_{uuid.uuid4().hex[:8]}")
    params = {"scope": scope, "body": "x"}
    runs = []
    subplans: list[str] = []
    with _remote_commands(citus, subplans) as (db, sent):
        engine = rp.Engine(db)
        engine.register(op)
        for _ in range(2):
            sent.clear()
            engine.run(op, key="k", params=params, scope=scope)
            runs.append(list(sent))
    fresh, replay = runs
    # None: the claim and the writes that record a phase are plain statements (the claim in
    # a query that formatted its row, and the guarded write of one server, ran as 1, 3 and 4
    # subplans here).
    assert subplans == [], subplans
    assert len({worker for _, worker in fresh}) == 1, fresh
    commands = [command for command, _ in fresh]
    assert commands.count("COMMIT") == 2 and not any("PREPARE" in c for c in commands)
    assert len(commands) <= 12, commands  # as docs/how-to/citus.md lists them
    # The claim's trigger binds the new key's first phase to the worker: no statement of its
    # own after the claim (the fence binds the later phase, in the same statement).
    assert not any(c.startswith("SELECT pg_export_snapshot()") for c in commands), commands
    assert len(replay) == 1 and replay[0][0].startswith("SELECT")


def test_the_async_engine_runs_and_replays(citus: sa.Engine, scope: str) -> None:
    op = _async_notes(f"citus_async_{uuid.uuid4().hex[:8]}")
    url = citus.url.render_as_string(hide_password=False)

    async def both() -> tuple[rp.Outcome, rp.Outcome]:
        engine = rp.AsyncEngine(url)
        engine.register(op)
        try:
            params = {"scope": scope, "body": "hi"}
            first = await engine.run(op, key="k", params=params, scope=scope)
            return first, await engine.run(op, key="k", params=params, scope=scope)
        finally:
            await engine.dispose()

    first, again = asyncio.run(both())
    assert (first.status, again.replayed) == (201, True)
    assert _count(citus, "SELECT count(*) FROM citus_notes WHERE scope = :s", s=scope) == 1


def _async_notes(name: str) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("noted")
    async def note(tx: Any, params: Any) -> None:
        await tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, %(b)s)",
            {"s": params["scope"], "k": tx.key_id, "b": params["body"]},
        )
        tx.stage_job("notify", {"n": 1})

    @op.atomic_phase("finished")
    async def finish(tx: Any, params: Any) -> rp.Response:
        return rp.Response(201, {"body": params["body"]})

    return op


def test_a_phase_that_ends_its_transaction_records_no_point(citus: sa.Engine, scope: str) -> None:
    op: rp.Operation[Any] = rp.Operation(f"citus_ends_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("noted")
    def note(tx: rp.AtomicContext, params: Any) -> None:
        libpq = tx.connection.connection.driver_connection.pgconn  # under every guard
        tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, 'leaked')",
            {"s": scope, "k": tx.key_id},
        )
        libpq.exec_(b"COMMIT")  # past the guard, which refuses psycopg's own commit()
        libpq.exec_(b"BEGIN")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {})

    engine = rp.Engine(citus)
    engine.register(op)
    with pytest.raises(rp.TransactionEnded):
        engine.run(op, key="k", params={}, scope=scope)
    point = "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND recovery_point = 'noted'"
    assert _count(citus, point, s=scope) == 0


def test_the_completer_enqueuer_and_reaper_finish_publish_and_delete(
    citus: sa.Engine, scope: str
) -> None:
    published: list[Job] = []
    backend = InProcessBackend({"notify": published.append})
    op = _notes(f"citus_workers_{uuid.uuid4().hex[:8]}", fail_once=[True])
    engine = rp.Engine(citus, jobs=backend, retry_base=0.01, retry_cap=0.01)
    engine.register(op)
    params = {"scope": scope, "body": "later"}

    with pytest.raises(RuntimeError):  # the foreign step fails: the key is left unfinished
        engine.run(op, key="k", params=params, scope=scope)
    # Two completers side by side: the key is finished once.
    results = [Completer(engine, min_age=0).run_once() for _ in range(2)]
    assert sum(r.finished for r in results) == 1
    assert engine.run(op, key="k", params=params, scope=scope).replayed

    with citus.connect() as conn:
        staged = conn.execute(
            sa.text("SELECT job_key FROM staged_jobs WHERE scope = :s"), {"s": scope}
        ).scalars()
        ours = set(staged)
    assert len(ours) == 3
    while Enqueuer(engine).run_once().published:
        pass
    assert _count(citus, "SELECT count(*) FROM staged_jobs WHERE scope = :s", s=scope) == 0
    mine = [job for job in published if job.job_key in ours]
    assert sorted(job.args["n"] for job in mine) == [1, 2, 3]  # each published once
    assert {job.scope for job in mine} == {scope}  # for consume_once

    Reaper(engine, retention=timedelta(0), abandoned_retention=timedelta(0)).run_once()
    keys = "SELECT count(*) FROM idempotency_keys WHERE scope = :s"
    assert _count(citus, keys, s=scope) == 0


def test_a_takeover_after_the_lease_expired(citus: sa.Engine, scope: str) -> None:
    op = _notes(f"citus_takeover_{uuid.uuid4().hex[:8]}", lock_timeout=timedelta(seconds=1))
    engine = rp.Engine(citus)
    engine.register(op)
    with citus.begin() as conn:  # a request that died holding the lease, long ago
        conn.execute(
            sa.text(
                "INSERT INTO idempotency_keys (scope, operation, idempotency_key, "
                "operation_version, request_method, request_path, request_params, "
                "fingerprint, locked_at, lock_token) "
                "VALUES (:s, :op, 'k', 1, 'POST', '/', CAST(:p AS jsonb), 'f', "
                "now() - interval '1 hour', gen_random_uuid())"
            ),
            {"s": scope, "op": op.name, "p": json.dumps({"scope": scope, "body": "x"})},
        )
    key_id = _count(citus, "SELECT id FROM idempotency_keys WHERE scope = :s", s=scope)
    outcome = engine.resume(key_id, scope=scope)
    assert outcome.status == 201
    assert _count(citus, "SELECT count(*) FROM citus_notes WHERE scope = :s", s=scope) == 1


def test_a_phase_that_changes_its_key_row_commits_nothing(citus: sa.Engine, scope: str) -> None:
    # The write that records the phase misses its row, so nothing commits, and the error
    # says which miss it was, as on one server: the row changed (RP001), not the
    # transaction ended (the coordinator's transaction still holds its token).
    op: rp.Operation[Any] = rp.Operation(f"citus_row_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "UPDATE idempotency_keys SET lock_token = %(t)s WHERE scope = %(s)s AND id = %(k)s",
            {"t": uuid.uuid4(), "s": scope, "k": tx.key_id},
        )
        return rp.Response(201, {})

    engine = rp.Engine(citus)
    engine.register(op)
    with pytest.raises(rp.LockLost, match="the key row changed under the phase"):
        engine.run(op, key="k", params={}, scope=scope)
    finished = "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND finished_at IS NOT NULL"
    assert _count(citus, finished, s=scope) == 0


# A phase stays in its scope: one that writes on another worker too (which Citus would
# commit by two-phase commit, where SERIALIZABLE does not hold) fails at its COMMIT, and
# nothing commits on any worker.

OUTSIDE = [
    pytest.param(
        "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(other)s, %(k)s, 'theirs')",
        id="another-scopes-row",
    ),
    pytest.param("INSERT INTO citus_plans (name) VALUES (%(other)s)", id="a-reference-table"),
    pytest.param("UPDATE citus_notes SET body = 'all' WHERE key_id = %(k)s", id="every-shard"),
]


@pytest.mark.parametrize("write", OUTSIDE)
def test_a_phase_that_writes_outside_its_scope_is_refused_and_commits_nothing(
    citus: sa.Engine, scope: str, other_scope: str, write: str
) -> None:
    op: rp.Operation[Any] = rp.Operation(f"citus_left_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, 'ours')",
            {"s": scope, "k": tx.key_id},
        )
        tx.execute(write, {"other": other_scope, "k": tx.key_id})
        return rp.Response(201, {})

    engine = rp.Engine(citus)
    engine.register(op)
    with pytest.raises(rp.PhaseLeftScope, match="wrote outside its scope"):
        engine.run(op, key="k", params={}, scope=scope)
    # The phase ran in the claim's transaction: no key, no row on either worker, and no
    # transaction left prepared.
    assert _count(citus, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0
    notes = "SELECT count(*) FROM citus_notes WHERE scope = ANY(:s)"
    assert _count(citus, notes, s=[scope, other_scope]) == 0
    assert _count(citus, "SELECT count(*) FROM citus_plans WHERE name = :s", s=other_scope) == 0
    assert _prepared_on_workers(citus) == 0


# On the scope's own worker too: a write to another scope's shard there is refused before
# COMMIT (the trigger recoverypoint.distribute installs), though Citus would commit it
# without two-phase commit, as the two scopes are apart once a rebalance moves one. Reads
# and row locks are free.

ON_ITS_WORKER = [
    pytest.param(
        "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(other)s, %(k)s, 'theirs')",
        id="a-row-of-another-scope",
    ),
    pytest.param("DELETE FROM citus_notes WHERE scope = %(other)s", id="a-delete"),
    pytest.param(
        "UPDATE idempotency_keys SET last_error = 'x' WHERE scope = %(other)s",
        id="another-scopes-key",
    ),
]


def _finishing(
    name: str, body: Callable[[rp.AtomicContext], None], *, after_a_step: bool
) -> rp.Operation[Any]:
    """An operation whose finishing phase runs ``body`` and answers 201: its first phase, in
    the claim's transaction, or (``after_a_step``) a phase after a foreign step, in a fenced
    one."""
    op: rp.Operation[Any] = rp.Operation(f"{name}_{uuid.uuid4().hex[:8]}")
    if after_a_step:

        @op.foreign_step("called")
        def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
            return {}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        body(tx)
        return rp.Response(201, {})

    return op


@pytest.mark.parametrize("write", ON_ITS_WORKER)
@pytest.mark.parametrize("later", [False, True], ids=["first-phase", "after-a-step"])
def test_a_phase_that_writes_another_scope_on_its_own_worker_is_refused(
    citus: sa.Engine, scope: str, neighbour_scope: str, write: str, later: bool
) -> None:
    with citus.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO citus_notes (scope, key_id, body) VALUES (:s, -1, 'before')"),
            {"s": neighbour_scope},
        )

    def finish(tx: rp.AtomicContext) -> None:
        tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, 'ours')",
            {"s": scope, "k": tx.key_id},
        )
        tx.execute(write, {"other": neighbour_scope, "k": tx.key_id})

    op = _finishing("citus_neighbour", finish, after_a_step=later)
    engine = rp.Engine(citus)
    engine.register(op)
    with pytest.raises(rp.PhaseLeftScope, match="wrote outside its scope") as raised:
        engine.run(op, key="k", params={}, scope=scope)
    assert "citus_notes" in str(raised.value.__cause__) or "idempotency_keys" in str(
        raised.value.__cause__
    )
    keys = "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND finished_at IS NOT NULL"
    assert _count(citus, keys, s=scope) == 0
    notes = "SELECT count(*) FROM citus_notes WHERE scope = ANY(:s) AND body <> 'before'"
    assert _count(citus, notes, s=[scope, neighbour_scope]) == 0


def test_a_phase_that_reads_and_locks_other_scopes_and_reference_tables_commits(
    citus: sa.Engine, scope: str, neighbour_scope: str
) -> None:
    with citus.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO citus_notes (scope, key_id, body) VALUES (:s, -1, 'before')"),
            {"s": neighbour_scope},
        )
        conn.execute(
            sa.text("INSERT INTO citus_plans (name) VALUES (:s) ON CONFLICT DO NOTHING"),
            {"s": "basic"},
        )
    op: rp.Operation[Any] = rp.Operation(f"citus_reads_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, 'ours')",
            {"s": scope, "k": tx.key_id},
        )
        # On the scope's worker, after the write: a read and a row lock of another scope's
        # rows, and of a reference table's (as a foreign key's check takes).
        body = tx.scalar(
            "SELECT body FROM citus_notes WHERE scope = %(n)s FOR UPDATE", {"n": neighbour_scope}
        )
        plan = tx.scalar("SELECT name FROM citus_plans WHERE name = 'basic' FOR KEY SHARE")
        return rp.Response(201, {"body": body, "plan": plan})

    engine = rp.Engine(citus)
    engine.register(op)
    answer = engine.run(op, key="k", params={}, scope=scope)
    assert (answer.status, answer.body) == (201, {"body": "before", "plan": "basic"})
    assert _count(citus, "SELECT count(*) FROM citus_notes WHERE scope = :s", s=scope) == 1


def test_a_later_phase_of_the_async_engine_that_writes_another_scope_is_refused(
    citus: sa.Engine, scope: str, other_scope: str
) -> None:
    """A phase after a foreign step (its transaction begins with the fence): refused too;
    the step's result is kept, and the key waits for its next attempt with the error."""
    op: rp.Operation[Any] = rp.Operation(f"citus_later_{uuid.uuid4().hex[:8]}")

    @op.atomic_phase("noted")
    async def note(tx: Any, params: Any) -> None:
        await tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, 'ours')",
            {"s": scope, "k": tx.key_id},
        )

    @op.foreign_step("called")
    async def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        return {}

    @op.atomic_phase("finished")
    async def finish(tx: Any, params: Any) -> rp.Response:
        await tx.execute(
            "UPDATE citus_notes SET body = 'theirs' WHERE scope = %(other)s",
            {"other": other_scope},
        )
        await tx.execute(
            "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(other)s, 0, 'theirs')",
            {"other": other_scope},
        )
        return rp.Response(201, {})

    async def run() -> None:
        engine = rp.AsyncEngine(citus.url.render_as_string(hide_password=False))
        engine.register(op)
        try:
            await engine.run(op, key="k", params={}, scope=scope)
        finally:
            await engine.dispose()

    with pytest.raises(rp.PhaseLeftScope):
        asyncio.run(run())
    row = _key_row(citus, scope)
    assert (row.recovery_point, row.finished_at, row.lock_token) == ("called", None, None)
    assert row.last_error.startswith("PhaseLeftScope: atomic phase 'finished'")
    notes = "SELECT count(*) FROM citus_notes WHERE scope = :s"
    assert _count(citus, notes, s=other_scope) == 0
    assert _prepared_on_workers(citus) == 0


def test_a_compensation_that_writes_a_reference_table_is_refused(
    citus: sa.Engine, scope: str
) -> None:
    op = _notes(f"citus_compensate_{uuid.uuid4().hex[:8]}", fail_once=[True], max_attempts=1)

    @op.compensation
    def refund(tx: rp.AtomicContext, params: Any) -> None:
        tx.execute("INSERT INTO citus_plans (name) VALUES (%(s)s)", {"s": scope})

    engine = rp.Engine(citus, retry_base=0.01, retry_cap=0.01)
    engine.register(op)
    with pytest.raises(RuntimeError):
        engine.run(op, key="k", params={"scope": scope, "body": "x"}, scope=scope)
    passed = Completer(engine, min_age=0).run_once()
    assert (passed.abandoned, passed.compensated, passed.compensation_failed) == (1, 0, 1)
    assert _key_row(citus, scope).compensated_at is None
    assert _count(citus, "SELECT count(*) FROM citus_plans WHERE name = :s", s=scope) == 0


def test_instances_that_run_migrate_citus_at_once_all_succeed(citus: sa.Engine) -> None:
    """Several instances starting at once each run ``migrate --citus``: the first does the
    work, the others find it done (two replaced the trigger's function at once, and one
    failed with "tuple concurrently updated")."""
    instances = 4
    engines = [create_engine(citus.url, poolclass=sa.NullPool) for _ in range(instances)]
    at_once = threading.Barrier(instances)
    failed: list[BaseException] = []

    def migrate(db: sa.Engine) -> None:
        at_once.wait()
        try:
            distribute.distribute(db, ["citus_notes"])
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=migrate, args=(db,)) for db in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for db in engines:
        db.dispose()
    assert not failed, failed


@pytest.mark.parametrize("later", [False, True], ids=["first-phase", "after-a-step"])
def test_a_phase_that_leaves_a_savepoint_open_commits_on_its_worker(
    citus: sa.Engine, scope: str, later: bool
) -> None:
    """A savepoint rolled back stays open (ROLLBACK TO keeps it): the write that records the
    phase then runs in a subtransaction, where PostgreSQL refuses to export a snapshot. The
    phase is bound to its worker before its code runs, so it commits all the same."""

    def finish(tx: rp.AtomicContext) -> None:
        note = "INSERT INTO citus_notes (scope, key_id, body) VALUES (%(s)s, %(k)s, %(b)s)"
        savepoint = tx.connection.begin_nested()
        tx.execute(note, {"s": scope, "k": tx.key_id, "b": "undone"})
        savepoint.rollback()
        tx.execute(note, {"s": scope, "k": tx.key_id, "b": "kept"})

    op = _finishing("citus_savepoint", finish, after_a_step=later)
    engine = rp.Engine(citus)
    engine.register(op)
    assert engine.run(op, key="k", params={}, scope=scope).status == 201
    bodies = "SELECT string_agg(body, ',') FROM citus_notes WHERE scope = :s"
    with citus.connect() as conn:
        assert conn.execute(sa.text(bodies), {"s": scope}).scalar_one() == "kept"
    assert _prepared_on_workers(citus) == 0


def test_an_engine_refuses_distributed_keys_without_the_trigger_that_binds_new_keys(
    citus: sa.Engine, scope: str
) -> None:
    """Keys distributed by an older release, without the trigger that binds a new key's
    first phase to its worker: the engine, which no longer binds it with a statement of its
    own, refuses to run, saying what to do, rather than let that phase commit on two
    workers; ``migrate --citus`` mends it."""
    with citus.begin() as conn:
        conn.exec_driver_sql("SET LOCAL citus.enable_unsafe_triggers = on")
        conn.exec_driver_sql("DROP TRIGGER recoverypoint_binds_new_key ON idempotency_keys")
    try:
        op = _notes(f"citus_older_{uuid.uuid4().hex[:8]}")
        engine = rp.Engine(citus)
        engine.register(op)
        with pytest.raises(rp.ConfigurationError, match="migrate --citus"):
            engine.run(op, key="k", params={"scope": scope, "body": "x"}, scope=scope)
    finally:
        distribute.distribute(citus, ["citus_notes"])
    assert _count(citus, "SELECT count(*) FROM idempotency_keys WHERE scope = :s", s=scope) == 0
    engine = rp.Engine(citus)
    engine.register(op)
    assert engine.run(op, key="k", params={"scope": scope, "body": "x"}, scope=scope).status == 201


def test_migrate_moves_a_reference_table_onto_the_scopes_shards(citus: sa.Engine) -> None:
    """As ``migrate --citus`` moves ``processed_messages``, a reference table before
    migration 0014: made local again, then distributed with the keys, its rows with it."""
    with citus.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS citus_moved")
        conn.exec_driver_sql(
            "CREATE TABLE citus_moved (scope text, id int, PRIMARY KEY (scope, id))"
        )
        conn.exec_driver_sql("SELECT create_reference_table('citus_moved')")
        conn.exec_driver_sql("INSERT INTO citus_moved VALUES ('a', 1), ('b', 2)")
    try:
        assert distribute.distribute(citus, ["citus_moved"]) == ["citus_moved"]
        with_keys = (
            "SELECT count(*) FROM pg_dist_partition AS t, pg_dist_partition AS k "
            "WHERE t.logicalrelid = CAST('citus_moved' AS regclass) AND t.partmethod = 'h' "
            "AND k.logicalrelid = CAST('idempotency_keys' AS regclass) "
            "AND t.colocationid = k.colocationid"
        )
        assert _count(citus, with_keys) == 1
        assert _count(citus, "SELECT count(*) FROM citus_moved") == 2
        assert distribute.distribute(citus, ["citus_moved"]) == []  # placed: left alone
    finally:
        with citus.begin() as conn:
            conn.exec_driver_sql("DROP TABLE citus_moved")


def test_a_consumed_job_commits_on_its_scopes_worker_alone(citus: sa.Engine, scope: str) -> None:
    """consume_once's record is on the job's scope's shard: with the consumer's write to a
    row of that scope it commits on one worker, without two-phase commit."""
    job_key = f"job-{uuid.uuid4().hex}"
    with _remote_commands(citus) as (db, sent):
        with db.begin() as conn:
            assert consume_once(conn, "citus_receipt", job_key, scope=scope)
            conn.execute(
                sa.text("INSERT INTO citus_notes (scope, key_id, body) VALUES (:s, 1, 'sent')"),
                {"s": scope},
            )
        consumed = list(sent)
        with db.begin() as conn:  # delivered again: recognised
            assert not consume_once(conn, "citus_receipt", job_key, scope=scope)
    assert len({worker for _, worker in consumed}) == 1, consumed
    commands = [command for command, _ in consumed]
    assert "COMMIT" in commands and not any("PREPARE" in c for c in commands), commands

    # The reaper prunes the records scope by scope.
    with citus.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE processed_messages SET processed_at = now() - interval '8 days' "
                "WHERE scope = :s"
            ),
            {"s": scope},
        )
    Reaper(rp.Engine(citus), processed_retention=timedelta(days=7)).run_once()
    records = "SELECT count(*) FROM processed_messages WHERE scope = :s"
    assert _count(citus, records, s=scope) == 0


def test_the_completer_abandons_a_key_out_of_attempts(citus: sa.Engine, scope: str) -> None:
    op = _notes(f"citus_abandon_{uuid.uuid4().hex[:8]}", fail_once=[True], max_attempts=1)
    engine = rp.Engine(citus, retry_base=0.01, retry_cap=0.01)
    engine.register(op)
    params = {"scope": scope, "body": "x"}
    with pytest.raises(RuntimeError):
        engine.run(op, key="k", params=params, scope=scope)

    assert Completer(engine, min_age=0).run_once().abandoned == 1
    replayed = engine.run(op, key="k", params=params, scope=scope)
    assert (replayed.status, replayed.replayed) == (500, True)
    abandoned = (
        "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND abandoned_at IS NOT NULL"
    )
    assert _count(citus, abandoned, s=scope) == 1


# The operator's commands: each reads its keys or jobs across scopes without locks, then
# acts on each scope's rows with the scope in the statement (one shard each).


def _leased(db: sa.Engine, scope: str, op: str, key: str, *, held: str, timeout: int) -> int:
    """An unfinished key of ``scope`` whose lease was taken ``held`` ago, with ``timeout``."""
    with db.begin() as conn:
        return int(
            conn.execute(
                sa.text(
                    "INSERT INTO idempotency_keys (scope, operation, idempotency_key, "
                    "operation_version, request_method, request_path, request_params, "
                    "fingerprint, locked_at, lock_token, lock_timeout) "
                    "VALUES (:s, :op, :k, 1, 'POST', '/', '{}'::jsonb, 'f', "
                    "now() - CAST(:held AS interval), gen_random_uuid(), :timeout) RETURNING id"
                ),
                {"s": scope, "op": op, "k": key, "held": held, "timeout": timeout},
            ).scalar_one()
        )


def _cli(citus: sa.Engine, *args: str) -> subprocess.CompletedProcess[str]:
    url = citus.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", *args, "--database-url", url],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_keys_release_and_abandon_check_the_lease_as_read(citus: sa.Engine, scope: str) -> None:
    operator = admin.Admin(citus, actor="citus@test")
    op = f"citus_admin_{uuid.uuid4().hex[:8]}"
    expired = _leased(citus, scope, op, "expired", held="1 hour", timeout=1)
    live = _leased(citus, scope, op, "live", held="0 seconds", timeout=3600)
    other_scope = f"{scope}-b"
    elsewhere = _leased(citus, other_scope, op, "expired", held="1 hour", timeout=1)

    released = _cli(citus, "keys", "release", str(expired))
    assert released.returncode == 0, released.stderr
    with pytest.raises(admin.Refused, match="live lease"):
        admin.release(operator, live)
    assert admin.release(operator, live, force=True).changed == (live,)
    free = "SELECT count(*) FROM idempotency_keys WHERE scope = :s AND lock_token IS NULL"
    assert _count(citus, free, s=scope) == 2

    # Many keys over two scopes: one statement per scope, all in one transaction.
    result = admin.abandon(operator, admin.KeyFilter(operation=op, limit=None))
    assert sorted(result.changed) == sorted([expired, live, elsewhere])
    abandoned = (
        "SELECT count(*) FROM idempotency_keys WHERE scope = ANY(:s) "
        "AND abandoned_at IS NOT NULL AND response_status = 500"
    )
    assert _count(citus, abandoned, s=[scope, other_scope]) == 3


def test_keys_purge_and_jobs_delete(citus: sa.Engine, scope: str) -> None:
    operator = admin.Admin(citus, actor="citus@test")
    op = _notes(f"citus_purge_{uuid.uuid4().hex[:8]}")
    engine = rp.Engine(citus)
    engine.register(op)
    scopes = [scope, f"{scope}-b"]
    for s in scopes:
        engine.run(op, key="k", params={"scope": s, "body": "x"}, scope=s)
    jobs = "SELECT count(*) FROM staged_jobs WHERE scope = ANY(:s)"
    assert _count(citus, jobs, s=scopes) == 6

    first_key = _count(citus, "SELECT id FROM idempotency_keys WHERE scope = :s", s=scope)
    deleted = _cli(citus, "jobs", "delete", "--key-id", str(first_key), "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert _count(citus, jobs, s=scopes) == 3
    assert admin.retry_jobs(operator, admin.JobFilter(name="notify", limit=None)).changed

    with citus.begin() as conn:
        for s in scopes:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET finished_at = now() - interval '2 days' "
                    "WHERE scope = :s"
                ),
                {"s": s},
            )
    with citus.connect() as conn:
        ids = conn.execute(
            sa.text("SELECT id FROM idempotency_keys WHERE scope = ANY(:s)"), {"s": scopes}
        ).scalars()
        doomed = set(ids)
    # A batch of one: the purge goes scope by scope, and batch by batch within each.
    purged = admin.purge(operator, timedelta(days=1), batch_size=1)
    assert doomed <= set(purged.changed)
    keys = "SELECT count(*) FROM idempotency_keys WHERE scope = ANY(:s)"
    assert _count(citus, keys, s=scopes) == 0
    unlinked = (
        "SELECT count(*) FROM staged_jobs WHERE scope = ANY(:s) AND idempotency_key_id IS NULL"
    )
    assert _count(citus, unlinked, s=scopes) == 3


def test_an_action_behind_a_running_phase_is_refused_after_its_wait(
    citus: sa.Engine, scope: str
) -> None:
    """The row is locked on its worker: the action's lock timeout must reach it there."""
    key_id = _leased(citus, scope, "citus_wait", "k", held="1 hour", timeout=1)
    with citus.connect() as holder, holder.begin():
        holder.execute(
            sa.text("SELECT 1 FROM idempotency_keys WHERE scope = :s AND id = :i FOR UPDATE"),
            {"s": scope, "i": key_id},
        )
        with pytest.raises(admin.Refused, match="running phase"):
            admin.release(admin.Admin(citus, lock_wait=0.2), key_id)
    assert admin.release(admin.Admin(citus), key_id).changed == (key_id,)


# The rules about time (attempts, leases, generations, windows, compensations): each
# statement of theirs on a real cluster. Time moves by writing a scope's moments back with
# constants: Citus refuses `column - interval` in an UPDATE (testing.Clock's way).


def _key_row(db: sa.Engine, scope: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text("SELECT * FROM idempotency_keys WHERE scope = :s"), {"s": scope}
        ).one()


def _finished_long_ago(db: sa.Engine, scope: str) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET finished_at = now() - interval '40 days' "
                "WHERE scope = :s"
            ),
            {"s": scope},
        )


def test_a_reused_key_gets_a_new_generation_the_reaper_records_and_prunes(
    citus: sa.Engine, scope: str
) -> None:
    op = _notes(f"citus_generations_{uuid.uuid4().hex[:8]}")
    engine = rp.Engine(citus)
    engine.register(op)
    params = {"scope": scope, "body": "x"}
    engine.run(op, key="k", params=params, scope=scope)

    # Past its retention (the row still there): the claim deletes it and inserts generation 1.
    _finished_long_ago(citus, scope)
    again = engine.run(op, key="k", params=params, scope=scope)
    assert not again.replayed and _key_row(citus, scope).generation == 1

    # Reaped: its next generation recorded, which the reuse after it takes.
    _finished_long_ago(citus, scope)
    Reaper(engine, retention=timedelta(days=1)).run_once()
    recorded = "SELECT generation FROM key_generations WHERE scope = :s"
    assert _count(citus, recorded, s=scope) == 2
    third = engine.run(op, key="k", params=params, scope=scope)
    assert not third.replayed and _key_row(citus, scope).generation == 2

    # The record, once past the generations' retention, is pruned.
    with citus.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE key_generations SET deleted_at = now() - interval '40 days' "
                "WHERE scope = :s"
            ),
            {"s": scope},
        )
    Reaper(engine, generations_retention=timedelta(days=30)).run_once()
    assert _count(citus, "SELECT count(*) FROM key_generations WHERE scope = :s", s=scope) == 0
    # Each use ran its phases: a new request, not a replay.
    assert _count(citus, "SELECT count(*) FROM citus_notes WHERE scope = :s", s=scope) == 3


def test_a_crash_counts_an_attempt_and_a_takeover_backs_the_key_off(
    citus: sa.Engine, scope: str
) -> None:
    op = _notes(f"citus_crash_{uuid.uuid4().hex[:8]}", lock_timeout=timedelta(seconds=1))
    engine = rp.Engine(citus, retry_base=60.0, retry_cap=60.0)
    engine.register(op)
    key_id = _leased(citus, scope, op.name, "k", held="1 hour", timeout=1)  # died holding it
    with citus.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET request_params = CAST(:p AS jsonb), attempts = 1 "
                    "WHERE scope = :s"),
            {"s": scope, "p": json.dumps({"scope": scope, "body": "x"})},
        )  # fmt: skip
    assert engine.resume(key_id, scope=scope).status == 201
    # The takeover counted its attempt and scheduled the next one by the back-off (30-60 s).
    row = _key_row(citus, scope)
    assert row.attempts == 2
    assert 29 <= (row.next_attempt_at - row.last_run_at).total_seconds() <= 61


def test_a_live_holders_lease_is_renewed_while_its_step_runs(citus: sa.Engine, scope: str) -> None:
    op: rp.Operation[Any] = rp.Operation(
        f"citus_heartbeat_{uuid.uuid4().hex[:8]}", lock_timeout=timedelta(seconds=1)
    )
    renewed = threading.Event()

    @op.foreign_step("called")
    def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        first = _key_row(citus, scope).locked_at
        while not renewed.wait(0.05):  # until the renewer has written a later lease
            if _key_row(citus, scope).locked_at > first:
                renewed.set()
            assert not step.lease_lost
        return {}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {})

    engine = rp.Engine(citus)
    engine.register(op)
    assert engine.run(op, key="k", params={}, scope=scope).status == 201
    assert renewed.is_set()


def test_a_key_past_its_providers_window_is_held_for_an_operator(
    citus: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation(f"citus_window_{uuid.uuid4().hex[:8]}")
    calls: list[str] = []

    @op.atomic_phase("noted")
    def note(tx: rp.AtomicContext, params: Any) -> None:
        pass

    @op.foreign_step("called", dedupe_window=timedelta(hours=24))
    def call(step: rp.StepContext, params: Any) -> dict[str, Any]:
        calls.append(step.downstream_key())
        raise rp.Retryable("the answer was lost")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {})

    engine = rp.Engine(citus, retry_base=0.01, retry_cap=0.01)
    engine.register(op)
    with pytest.raises(rp.Retryable):
        engine.run(op, key="k", params={}, scope=scope)
    with citus.begin() as conn:  # two days later: the provider has forgotten the key
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET point_reached_at = now() - interval '2 days' "
                "WHERE scope = :s"
            ),
            {"s": scope},
        )
    with pytest.raises(rp.NeedsReconciliation):
        engine.run(op, key="k", params={}, scope=scope)
    row = _key_row(citus, scope)
    # Held, its lease given up, the attempt its claim counted given back; no second call.
    assert row.reconcile_since is not None and row.lock_token is None
    assert (row.attempts, len(calls)) == (1, 1)


def test_an_abandoned_key_is_compensated_once_after_a_failed_try(
    citus: sa.Engine, scope: str
) -> None:
    op = _notes(f"citus_compensated_{uuid.uuid4().hex[:8]}", fail_once=[True], max_attempts=1)
    refunds: list[int] = []

    @op.compensation
    def refund(tx: rp.AtomicContext, params: Any) -> None:
        refunds.append(tx.key_id)
        if len(refunds) == 1:
            raise RuntimeError("the refund provider is down")
        tx.stage_job("notify", {"refund": True})

    engine = rp.Engine(citus, retry_base=0.01, retry_cap=0.01)
    engine.register(op)
    with pytest.raises(RuntimeError):
        engine.run(op, key="k", params={"scope": scope, "body": "x"}, scope=scope)

    first = Completer(engine, min_age=0).run_once()
    assert (first.abandoned, first.compensated, first.compensation_failed) == (1, 0, 1)
    row = _key_row(citus, scope)
    assert row.lock_token is None and row.compensation_due_at > row.abandoned_at
    with citus.begin() as conn:  # the failed try's back-off has passed
        conn.execute(
            sa.text("UPDATE idempotency_keys SET compensation_due_at = now() WHERE scope = :s"),
            {"s": scope},
        )
    later = Completer(engine, min_age=0).run_once()
    assert (later.compensated, later.compensation_failed) == (1, 0)
    assert Completer(engine, min_age=0).run_once().compensated == 0
    assert len(refunds) == 2 and _key_row(citus, scope).compensated_at is not None


def test_rocket_rides_is_placed_so_its_phases_stay_in_their_scope(citus: sa.Engine) -> None:
    """``recoverypoint demo --existing`` on a coordinator: the example's migration makes its
    users (and the tables no phase writes) reference tables, then co-locates rides and
    audit_records, which refer to users, with the keys; a booked ride's phase commits."""
    from recoverypoint.demo.rocket_rides.schema import CO_LOCATED, REFERENCE, TABLES, migrate

    try:
        migrate(citus)
        placed = (
            "SELECT count(*) FROM pg_dist_partition AS t, pg_dist_partition AS k "
            "WHERE t.logicalrelid = CAST(:t AS regclass) AND t.partmethod = 'h' "
            "AND k.logicalrelid = CAST('idempotency_keys' AS regclass) "
            "AND t.colocationid = k.colocationid"
        )
        assert all(_count(citus, placed, t=t) == 1 for t in CO_LOCATED)
        reference = (
            "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid = CAST(:t AS regclass) "
            "AND partmethod = 'n'"
        )
        assert all(_count(citus, reference, t=t) == 1 for t in REFERENCE)
        assert distribute.make_reference(citus, REFERENCE) == []  # placed: left alone
    finally:
        with citus.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")


@contextmanager
def _database_on_every_node(citus: sa.Engine) -> Iterator[sa.Engine]:
    """A database of its own on the coordinator and on each worker, with the extension and
    the nodes added as in the cluster's database (``demo --existing`` refuses that one: it
    holds the other tests' keys); dropped on every node at the end. Made through the
    coordinator alone, which reaches its workers by the names it has for them."""
    name = f"rp_citus_demo_{uuid.uuid4().hex[:12]}"
    with citus.connect() as conn:
        nodes = conn.execute(
            sa.text(
                "SELECT nodename, nodeport, groupid FROM pg_dist_node "
                "WHERE noderole = 'primary' ORDER BY groupid"
            )
        ).all()
    hosts = [host for host, _, group in nodes if group != 0]
    ports = [port for _, port, group in nodes if group != 0]
    failed = "SELECT nodename, result FROM run_command_on_workers(:c) WHERE NOT success"
    cluster = create_engine(citus.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    db = create_engine(citus.url.set(database=name), poolclass=sa.NullPool)
    try:
        with cluster.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
            assert conn.execute(sa.text(failed), {"c": f"CREATE DATABASE {name}"}).all() == []
        with db.begin() as conn:
            conn.exec_driver_sql("CREATE EXTENSION citus")
            # In the new database on each worker (no node is added here yet).
            extension = (
                "SELECT node_name, result FROM master_run_on_worker(:h, :p, :c, false) "
                "WHERE NOT success"
            )
            commands = ["CREATE EXTENSION citus"] * len(hosts)
            created = conn.execute(sa.text(extension), {"h": hosts, "p": ports, "c": commands})
            assert created.all() == []
        with db.begin() as conn:
            for host, port, group in nodes:
                added = "citus_set_coordinator_host" if group == 0 else "citus_add_node"
                conn.execute(sa.text(f"SELECT {added}(:h, :p)"), {"h": host, "p": port})
        yield db
    finally:
        db.dispose()
        with cluster.connect() as conn:
            # FORCE: the run's connections (a killed process's) must not keep it.
            dropped = f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            conn.exec_driver_sql(dropped)
            assert conn.execute(sa.text(failed), {"c": dropped}).all() == []
        cluster.dispose()


def test_the_demo_runs_in_a_database_on_every_node_and_leaves_it_as_it_found_it(
    citus: sa.Engine, tmp_path: Path
) -> None:
    """``recoverypoint demo --existing`` on the coordinator, as tests/test_demo_existing.py
    runs it on one server: every invariant holds, recoverypoint's tables stay distributed
    without a row of the run's, the user's table is untouched, and the next run is taken."""
    with _database_on_every_node(citus) as db:
        with db.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY, total int)")
            conn.exec_driver_sql("INSERT INTO orders VALUES (1, 4200)")
        url = db.url.render_as_string(hide_password=False)
        run_in_it_and_check_it_is_left_as_found(url, db, tmp_path)
        # Placed as migrate --citus places them, on the cluster's workers, and left so.
        distributed = (
            "SELECT count(*) FROM pg_dist_partition WHERE partmethod = 'h' "
            "AND logicalrelid = ANY(CAST(:t AS regclass[]))"
        )
        assert _count(db, distributed, t=list(RECOVERYPOINT_ROWS)) == len(RECOVERYPOINT_ROWS)
        holding = (
            "SELECT count(DISTINCT nodename || ':' || nodeport) FROM citus_shards "
            "WHERE table_name = CAST('idempotency_keys' AS regclass)"
        )
        workers = "SELECT count(*) FROM pg_dist_node WHERE groupid <> 0 AND noderole = 'primary'"
        assert _count(db, holding) == _count(citus, workers)
        again = demo(url, "--existing", "--requests", "4")
        assert again.returncode == 0, again.stdout + again.stderr
