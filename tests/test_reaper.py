"""The reaper deletes exactly what is past its retention, in batches, and nothing live."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa
from workload import plant_keys, rows

import recoverypoint as rp
from recoverypoint.workers import Reaper, loop

FINISHED = {"point": "finished", "response_status": "200"}


def finished(age: str, *, abandoned: bool = False) -> dict[str, str]:
    """Columns of a key finished (or abandoned) ``age`` ago, e.g. ``'73 hours'``."""
    at = f"now() - interval '{age}'"
    columns = {**FINISHED, "finished_at": at, "created_at": at, "last_run_at": at}
    return {**columns, "abandoned_at": at} if abandoned else columns


@pytest.mark.slow
def test_deletes_exactly_the_eligible_keys_in_batches(worker_db: sa.Engine) -> None:
    doomed = [
        *plant_keys(worker_db, "op", 23, **finished("73 hours")),
        *plant_keys(worker_db, "op", 4, **finished("31 days", abandoned=True)),
    ]
    kept = [
        *plant_keys(worker_db, "op", 5, **finished("71 hours")),
        *plant_keys(worker_db, "op", 3, **finished("10 days", abandoned=True)),
        # Live keys, however old: never started again, halfway, or leased right now.
        *plant_keys(worker_db, "op", 3, created_at="now() - interval '400 days'"),
        *plant_keys(
            worker_db,
            "op",
            2,
            point="charged",
            created_at="now() - interval '100 days'",
            last_run_at="now() - interval '100 days'",
        ),
        *plant_keys(worker_db, "op", 2, locked_at="now()", lock_token="gen_random_uuid()"),
    ]
    with worker_db.begin() as conn:
        # A job of a key about to be reaped, and consume-once records old and new.
        conn.execute(
            sa.text(
                "INSERT INTO staged_jobs (scope, job_name, job_args, job_key, idempotency_key_id) "
                "SELECT scope, 'notify', '{}', 'job-of-a-reaped-key', id "
                "FROM idempotency_keys WHERE id = :k"
            ),
            {"k": doomed[0]},
        )
        conn.execute(
            sa.text(
                "INSERT INTO processed_messages (consumer, message_id, processed_at) "
                "SELECT 'c', 'old-' || n, now() - interval '8 days' FROM generate_series(1, 9) n "
                "UNION ALL SELECT 'c', 'new-' || n, now() - interval '6 days' "
                "FROM generate_series(1, 2) n"
            )
        )

    result = Reaper(rp.Engine(worker_db), batch_size=4).run_once()

    assert (result.finished, result.abandoned, result.messages) == (23, 4, 9)
    # 27 keys in batches of 4 (the 7th one short), one of generations (none due), 9
    # records (the 3rd one short).
    assert result.batches == 7 + 1 + 3
    remaining = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys ORDER BY id")]
    assert remaining == sorted(kept)
    [job] = rows(worker_db, "SELECT idempotency_key_id FROM staged_jobs")
    assert job.idempotency_key_id is None  # the job survives its key
    messages = rows(worker_db, "SELECT message_id FROM processed_messages ORDER BY 1")
    assert [m.message_id for m in messages] == ["new-1", "new-2"]

    assert not Reaper(rp.Engine(worker_db), batch_size=4).run_once()


@pytest.mark.slow
def test_retentions_are_settable_and_abandoned_keys_are_kept_at_least_as_long(
    worker_db: sa.Engine,
) -> None:
    engine = rp.Engine(worker_db)
    [hour_old] = plant_keys(worker_db, "op", 1, **finished("2 hours"))
    [abandoned] = plant_keys(worker_db, "op", 1, **finished("2 hours", abandoned=True))

    result = Reaper(engine, retention=timedelta(hours=1)).run_once()

    assert (result.finished, result.abandoned) == (1, 0)
    assert [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")] == [abandoned]
    assert hour_old != abandoned
    with pytest.raises(ValueError, match="abandoned_retention"):
        Reaper(engine, retention=timedelta(days=40))


@pytest.mark.slow
def test_retentions_may_be_zero_or_equal_never_negative(worker_db: sa.Engine) -> None:
    engine = rp.Engine(worker_db)
    Reaper(engine, retention=timedelta(0), abandoned_retention=timedelta(0))
    Reaper(engine, retention=timedelta(hours=1), abandoned_retention=timedelta(hours=1))
    for negative in ("retention", "abandoned_retention", "processed_retention"):
        with pytest.raises(ValueError, match="retentions must be >= 0"):
            Reaper(engine, **{negative: timedelta(seconds=-1)})


@pytest.mark.slow
def test_a_stop_shared_with_other_workers_stops_the_reaper(worker_db: sa.Engine) -> None:
    stop = threading.Event()
    reaper = Reaper(rp.Engine(worker_db), stop_event=stop)
    plant_keys(worker_db, "op", 2, **finished("73 hours"))

    stop.set()

    assert reaper.stopping and not reaper.run_once()
    assert len(rows(worker_db, "SELECT * FROM idempotency_keys")) == 2


def _dead_rows_and_manual_vacuums(db: sa.Engine) -> tuple[int, int]:
    with db.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            sa.text(
                "SELECT n_dead_tup, vacuum_count FROM pg_stat_user_tables "
                "WHERE relname = 'idempotency_keys'"
            )
        ).one()
    return row.n_dead_tup, row.vacuum_count


@pytest.mark.slow
def test_a_big_pass_leaves_the_table_vacuumed_when_autovacuum_is_off(
    worker_db: sa.Engine, layout: str
) -> None:
    if layout == "partitioned":
        pytest.skip("a partitioned table has no storage parameters: its partitions have")
    # Off for this table (whatever the server's setting): the reaper must clean up itself.
    with worker_db.begin() as conn:
        conn.execute(sa.text("ALTER TABLE idempotency_keys SET (autovacuum_enabled = off)"))
    plant_keys(worker_db, "op", 300, **finished("73 hours"))
    kept = plant_keys(worker_db, "op", 5, **finished("1 hour"))
    _, vacuums_before = _dead_rows_and_manual_vacuums(worker_db)

    small = Reaper(rp.Engine(worker_db), batch_size=100, vacuum_after=301).run_once()
    assert (small.finished, small.vacuumed) == (300, 0)  # below the threshold: no vacuum
    plant_keys(worker_db, "op", 300, **finished("73 hours"))
    big = Reaper(rp.Engine(worker_db), batch_size=100, vacuum_after=300).run_once()

    assert (big.finished, big.vacuumed) == (300, 1)
    # Statistics reach pg_stat_user_tables shortly after the statement (later on a busy
    # machine): poll until they do, a minute at most.
    deadline = time.monotonic() + 60
    dead, vacuums = _dead_rows_and_manual_vacuums(worker_db)
    while vacuums == vacuums_before and time.monotonic() < deadline:
        time.sleep(0.1)
        dead, vacuums = _dead_rows_and_manual_vacuums(worker_db)
    assert (dead, vacuums) == (0, vacuums_before + 1)  # both passes' dead rows are gone
    assert [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys ORDER BY id")] == kept


@pytest.mark.slow
def test_vacuum_after_must_be_positive_or_none(worker_db: sa.Engine) -> None:
    with pytest.raises(ValueError, match="vacuum_after"):
        Reaper(rp.Engine(worker_db), vacuum_after=0)
    assert Reaper(rp.Engine(worker_db), vacuum_after=None).vacuum_after is None


@pytest.mark.parametrize("distributed", [False, True], ids=["one server", "by scope"])
def test_every_scope_is_reaped_however_many_have_rows_due(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch, distributed: bool
) -> None:
    """On one server a batch takes due rows of every scope: keys finishing in more scopes
    than a pass lists (here 3 a listing) are reaped in one pass, not a listing's worth of
    scopes per interval. Scope by scope (as on Citus, where each batch names its scope)
    it takes passes, and deletes the same. Either way a row is matched in its own scope:
    the same key and generation of another scope, not due, stay (and that scope's
    consume-once record); each deleted key's generation is recorded in its scope, and its
    jobs, and only they, are unlinked."""
    monkeypatch.setattr(loop, "SCOPES_PER_PASS", 3)
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO idempotency_keys (scope, operation, idempotency_key,
                    operation_version, request_method, request_path, request_params,
                    fingerprint, recovery_point, response_status, finished_at, created_at)
                SELECT 's' || s, 'op', 'k' || k, 1, 'POST', '/test', '{}'::jsonb, 'fp', 'finished',
                    200, now() - make_interval(hours => CASE WHEN k < 3 THEN 73 ELSE 1 END),
                    now() - interval '80 hours'
                FROM generate_series(1, 10) AS s, generate_series(1, 3) AS k
                UNION ALL  -- k1 of another scope, finished an hour ago
                SELECT 'late', 'op', 'k1', 1, 'POST', '/test', '{}'::jsonb, 'fp', 'finished', 200,
                    now() - interval '1 hour', now() - interval '1 hour'
                """
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO staged_jobs (scope, job_name, job_args, job_key, idempotency_key_id) "
                "SELECT scope, 'notify', '{}', 'job-' || id, id FROM idempotency_keys"
            )
        )
        # A generation and a consume-once record per scope past their retentions, and the
        # same generation, and a record, of another scope within them.
        conn.execute(
            sa.text(
                "INSERT INTO key_generations (scope, operation, idempotency_key, generation, "
                "deleted_at) SELECT 's' || s, 'op', 'g', 4, now() - interval '31 days' "
                "FROM generate_series(1, 10) AS s "
                "UNION ALL SELECT 'late', 'op', 'g', 4, now() - interval '1 day'"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO processed_messages (scope, consumer, message_id, processed_at) "
                "SELECT 's' || s, 'c', 'm' || s, now() - interval '8 days' "
                "FROM generate_series(1, 10) AS s "
                "UNION ALL SELECT 'late', 'c', 'm', now() - interval '1 day'"
            )
        )
    reaper = Reaper(rp.Engine(worker_db), batch_size=7)
    reaper.distributed = distributed

    passes = [reaper.run_once()]
    while distributed and passes[-1]:
        passes.append(reaper.run_once())

    assert len(passes) == (5 if distributed else 1)  # by scope: 3 scopes a pass, then none
    assert [sum(getattr(p, what) for p in passes) for what in FIELDS] == [20, 10, 10]
    left = rows(worker_db, "SELECT scope, idempotency_key FROM idempotency_keys")
    assert sorted(left) == sorted([*((f"s{s}", "k3") for s in range(1, 11)), ("late", "k1")])
    recorded = rows(worker_db, "SELECT scope, idempotency_key, generation FROM key_generations")
    assert sorted(recorded) == sorted(
        [*((f"s{s}", f"k{k}", 1) for s in range(1, 11) for k in (1, 2)), ("late", "g", 4)]
    )
    messages = rows(worker_db, "SELECT scope, message_id FROM processed_messages")
    assert messages == [("late", "m")]
    linked = rows(
        worker_db,
        "SELECT j.scope, k.idempotency_key FROM staged_jobs AS j "
        "JOIN idempotency_keys AS k ON k.id = j.idempotency_key_id",
    )
    assert sorted(linked) == sorted(left)
    unlinked = rows(
        worker_db, "SELECT count(*) AS n FROM staged_jobs WHERE idempotency_key_id IS NULL"
    )
    assert unlinked[0].n == 20


FIELDS = ("finished", "generations", "messages")


def test_a_pass_ends_after_its_most_batches_and_the_next_goes_on(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys falling due as fast as batches take them cannot keep one pass running: it
    ends after its most full batches, and the next pass goes on."""
    monkeypatch.setattr(loop, "BATCHES_PER_PASS", 2)
    plant_keys(worker_db, "op", 9, **finished("73 hours"))
    reaper = Reaper(rp.Engine(worker_db), batch_size=2)

    assert [reaper.run_once().finished for _ in range(4)] == [4, 4, 1, 0]
