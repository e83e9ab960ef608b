"""Per-operation retention: the reaper holds each finished key to its operation's
``retention`` (else its own), abandoned keys to ``abandoned_retention`` as well, and
``keys show`` says the same date."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from workload import plant_keys, rows

import recoverypoint as rp
from recoverypoint.admin import Admin
from recoverypoint.admin.keys import find_key
from recoverypoint.workers import Reaper


def declared(name: str, retention: timedelta | None, version: int = 1) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name, version=version, retention=retention)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200)

    return op


def finished(age: str, *, abandoned: bool = False) -> dict[str, str]:
    at = f"now() - interval '{age}'"
    columns = {"point": "finished", "response_status": "200", "finished_at": at}
    return {**columns, "abandoned_at": at} if abandoned else columns


def test_each_key_is_held_to_its_operations_retention(worker_db: sa.Engine) -> None:
    short, long_, default = (
        declared("short", timedelta(hours=1)),
        declared("long", timedelta(days=10)),
        declared("default", None),
    )
    engine = rp.Engine(worker_db)
    engine.register(short, long_, default, declared("long", None, version=2))
    doomed = [
        *plant_keys(worker_db, "short", 2, **finished("2 hours")),
        *plant_keys(worker_db, "long", 2, **finished("11 days")),
        *plant_keys(worker_db, "default", 2, **finished("73 hours")),
        *plant_keys(worker_db, "long", 1, version=2, **finished("73 hours")),  # v2: default
        *plant_keys(worker_db, "short", 1, **finished("31 days", abandoned=True)),
    ]
    kept = [
        *plant_keys(worker_db, "short", 2, **finished("30 minutes")),
        *plant_keys(worker_db, "long", 2, **finished("9 days")),
        *plant_keys(worker_db, "default", 2, **finished("71 hours")),
        # Abandoned: not before abandoned_retention, however short the operation's.
        *plant_keys(worker_db, "short", 1, **finished("2 hours", abandoned=True)),
        # An operation this engine does not know: the reaper's own retention.
        *plant_keys(worker_db, "unknown", 1, **finished("71 hours")),
    ]

    result = Reaper(engine, batch_size=3).run_once()

    assert (result.finished, result.abandoned) == (len(doomed) - 1, 1)
    remaining = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys ORDER BY id")]
    assert remaining == sorted(kept)


@pytest.mark.parametrize(
    ("name", "age", "expected"),
    [("short", "2 hours", timedelta(hours=1)), ("default", "2 hours", timedelta(hours=72))],
)
def test_keys_show_says_when_the_reaper_deletes_the_key(
    worker_db: sa.Engine, name: str, age: str, expected: timedelta
) -> None:
    operations = (declared("short", timedelta(hours=1)), declared("default", None))
    [key_id] = plant_keys(worker_db, name, 1, **finished(age))
    shown = find_key(Admin(worker_db, operations), key_id)
    assert shown.reaped_after is not None and shown.row.finished_at is not None
    assert shown.reaped_after - shown.row.finished_at == expected


def test_retention_must_be_positive() -> None:
    with pytest.raises(rp.DeclarationError, match="retention"):
        rp.Operation("bad", retention=timedelta(0))
