"""Every console page with 1,000,000 keys stored answers quickly, server-side: under 200 ms
on an idle machine (the figures are printed), and asserted under 2 s, a bound a busy CI
machine cannot reach with a page that uses its indexes and a full read of the table cannot
stay under.

The table holds three days of traffic, as the reaper's 72 h retention leaves it: mostly
finished keys, one in 200 abandoned, one in 250 unfinished (stuck, waiting or in flight),
plus 20,000 staged jobs. Each page is requested once to warm up, then 5 times; the figure
is the median of the time the app took to answer (measured around the ASGI app, so the
test client's own overhead is left out). The listings and the overview must not read the
whole table: besides the time, PostgreSQL's own count of sequential scans of
``idempotency_keys`` must not move while the pages are served.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import MOUNT, app_for, client

from recoverypoint import admin, migrate
from recoverypoint.database import create_engine

pytestmark = [
    pytest.mark.slow,  # a million keys
    pytest.mark.xdist_group("console_scale"),  # written once for the module
]

KEYS = 1_000_000
# Seconds. Not the 200 ms target: a shared, loaded machine took 270 ms for pages that read
# a few index pages; a page that reads the whole table takes seconds even when idle.
BUDGET = 2.0
FILL = (Path(__file__).parent / "console_fill.sql").read_text()

# One key per 259 ms over 72 h; key n is unfinished when n % 250 = 1 (waiting when also
# n % 1000 = 1, in flight when n % 5000 = 1, else stuck), abandoned when n % 200 = 0.
PAGES = [
    "/",
    "/keys",
    "/keys?state=stuck",
    "/keys?state=in-flight",
    "/keys?state=unfinished",
    "/keys?state=abandoned",
    "/keys?state=finished",
    "/keys?state=stuck&state=in-flight&state=unfinished",
    "/keys?operation=op1",
    "/keys?operation=op1&state=stuck",
    "/keys?status=500",
    "/keys?point=reserved",
    "/keys?since=1h",
    "/keys?q=key-123456",
    "/keys?q=654321",
    "/keys?before=500000&limit=200",
    "/keys/999999",
    "/keys/250001",
    "/keys/250001/retry",
    "/keys/bulk/retry?state=stuck",
    "/keys/bulk/abandon?operation=op2&state=stuck",
    "/jobs",
    "/jobs?before=10000",
    "/audit",
]


class Timed:
    """The ASGI app, timing each request from its call to the end of its response."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.last = 0.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        start = time.perf_counter()
        await self.app(scope, receive, send)
        self.last = time.perf_counter() - start


@pytest.fixture(scope="module")
def db(module_database_url: str) -> Iterator[sa.Engine]:
    migrate.upgrade(module_database_url)
    engine = create_engine(module_database_url, pool_size=5)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        conn.exec_driver_sql(FILL)
        conn.exec_driver_sql(
            "INSERT INTO staged_jobs "
            "(scope, job_name, job_args, job_key, idempotency_key_id, created_at) "
            "SELECT coalesce(k.scope, ''), 'send_receipt', '{}', 'job-' || n, n * 50, "
            "now() - n * interval '1 second' "
            "FROM generate_series(1, 20000) AS n LEFT JOIN idempotency_keys AS k ON k.id = n * 50"
        )
    ops = admin.Admin(engine, actor="scale@test")
    admin.retry(ops, admin.KeyFilter(operation="op0", states=("stuck",), limit=3))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # What autovacuum does after a load: the visibility map and the planner's figures.
        conn.exec_driver_sql("VACUUM ANALYZE idempotency_keys, staged_jobs, audit_log")
    yield engine
    engine.dispose()


def seq_scans(db: sa.Engine) -> int:
    with db.connect() as conn:
        conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
        return int(
            conn.execute(
                sa.text(
                    "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'"
                )
            ).scalar_one()
        )


def test_the_table_holds_a_million_keys(db: sa.Engine) -> None:
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar() == KEYS


def test_every_page_answers_quickly_with_a_million_keys(db: sa.Engine) -> None:
    timed = Timed(app_for(admin.Admin(db)))
    medians: dict[str, float] = {}
    with client(timed, "operator") as browser:
        for path in PAGES:
            assert browser.get(MOUNT + path).status_code == 200, path
            runs = []
            for _ in range(5):
                assert browser.get(MOUNT + path).status_code == 200, path
                runs.append(timed.last)
            medians[path] = statistics.median(runs)
    report = "\n".join(f"{1000 * t:7.1f} ms  {path}" for path, t in medians.items())
    print(f"\nmedian of 5, server-side, {KEYS:,} keys:\n{report}")
    slow = {path: t for path, t in medians.items() if t >= BUDGET}
    assert not slow, report


def test_no_page_reads_the_whole_table(db: sa.Engine) -> None:
    # A backend sends its counts to the shared statistics when it has time (at most once a
    # second) or when it exits, which may be after the count is read again: the check then
    # passes whatever the page did. So each connection the pages used flushes them as it is
    # returned, before the request ends: pg_stat_force_next_flush() has the backend flush
    # them at its next transaction's end, before it answers that COMMIT.
    with db.connect() as conn:
        version = conn.exec_driver_sql("SHOW server_version_num").scalar_one()
    if int(version) < 150000:
        pytest.skip(
            "needs pg_stat_force_next_flush() (PostgreSQL 15): before it, a page's scans "
            "may be counted after the check"
        )
    pages_db = create_engine(db.url)

    @sa.event.listens_for(pages_db, "checkin")
    def flush_statistics(dbapi_connection: Any, record: Any) -> None:
        if dbapi_connection is not None:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SELECT pg_stat_force_next_flush()")
            dbapi_connection.commit()

    try:
        with client(app_for(admin.Admin(pages_db)), "operator") as browser:
            for path in PAGES:
                before = seq_scans(db)
                assert browser.get(MOUNT + path).status_code == 200
                assert seq_scans(db) == before, f"{path} read idempotency_keys sequentially"
    finally:
        pages_db.dispose()
