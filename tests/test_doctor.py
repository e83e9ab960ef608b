"""``recoverypoint doctor`` on real databases: a ready one passes, a missing schema or an
unreachable server fails in its own check, and piled-up keys and jobs, autovacuum turned
off and a skewed clock are warned about with what to do."""

from __future__ import annotations

import json
import re

import pytest
import sqlalchemy as sa
from console_site import TestClient  # imported there without Starlette's warning
from test_admin import OVERDUE, plant
from workload import one_recorded_pass, stage_jobs

from recoverypoint import admin
from recoverypoint.admin import doctor as doctor_module
from recoverypoint.cli import main
from recoverypoint.database import create_engine


def checks(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, dict[str, str]]]:
    status = main(["doctor", "--database-url", url, "--json"])
    found = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    return status, found


def test_a_ready_database_passes(
    worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, found = checks(worker_database_url, capsys)

    assert status == 0
    assert list(found) == ["database", "schema", "clock", "autovacuum", "workers",
                           "staged jobs", "keys", "unfinishable", "dedupe windows",
                           "compensations", "pooler"]  # fmt: skip
    for name in ("database", "schema", "clock", "staged jobs", "keys", "unfinishable",
                 "dedupe windows", "compensations", "pooler"):  # fmt: skip
        assert found[name]["status"] == "ok", found[name]
    assert "(head)" in found["schema"]["detail"]
    status = main(["doctor", "--database-url", worker_database_url])
    out = capsys.readouterr().out
    assert status == 0 and out.splitlines()[0].split() == ["check", "status", "detail", "what",
                                                           "to", "do"]  # fmt: skip


def test_an_unmigrated_database_fails_at_the_schema(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, found = checks(empty_database_url, capsys)
    assert status == 1 and list(found) == ["database", "schema"]
    assert found["schema"]["status"] == "fail"
    assert "recoverypoint migrate" in found["schema"]["hint"]


def test_an_unreachable_server_fails_at_the_database(capsys: pytest.CaptureFixture[str]) -> None:
    status, found = checks("postgresql://127.0.0.1:1/x", capsys)
    assert status == 1 and list(found) == ["database"]
    assert "refused" in found["database"]["detail"]


def test_stuck_keys_and_failing_jobs_are_warned_about(
    worker_db: sa.Engine, worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plant(worker_db, count=2, **OVERDUE)
    stage_jobs(worker_db, 1)
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE staged_jobs SET attempts = 1, last_error = 'down'"))

    status, found = checks(worker_database_url, capsys)

    assert status == 0  # warnings, not failures
    assert found["keys"]["status"] == "warn" and "2 stuck" in found["keys"]["detail"]
    assert "keys list --state stuck" in found["keys"]["hint"]
    assert found["staged jobs"]["status"] == "warn"
    assert "1 failing" in found["staged jobs"]["detail"]


def test_a_key_row_that_is_not_whole_fails_the_keys_check(
    worker_db: sa.Engine, worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # No CHECK constraint keeps them out since migration 0017: written here as something
    # else than recoverypoint could, a finished row without its response and an abandoned
    # one that is not finished, beside whole ones.
    whole = plant(worker_db, count=2, finished_at="now()", response_status="201")
    broken = plant(worker_db, finished_at="now()") + plant(worker_db, abandoned_at="now()")
    try:
        status, found = checks(worker_database_url, capsys)

        assert status == 1
        assert found["keys"]["status"] == "fail"
        assert "2 not whole" in found["keys"]["detail"]
        # The query the hint gives finds exactly those rows.
        hint = found["keys"]["hint"]
        assert "something else wrote to idempotency_keys" in hint
        query = re.search(r"`(SELECT [^`]*)`", hint)
        assert query is not None
        with worker_db.connect() as conn:
            assert sorted(conn.execute(sa.text(query[1])).scalars()) == sorted(broken)
    finally:
        with worker_db.begin() as conn:  # the suite checks every database for such rows
            conn.execute(sa.text("DELETE FROM idempotency_keys WHERE id = ANY(:ids)"),
                         {"ids": broken})  # fmt: skip
    assert whole


def test_autovacuum_turned_off_is_warned_about(worker_db: sa.Engine) -> None:
    with worker_db.begin() as conn:
        conn.execute(sa.text("ALTER TABLE staged_jobs SET (autovacuum_enabled = false)"))
        server_on = conn.execute(sa.text("SHOW autovacuum")).scalar() == "on"
    [check] = [c for c in admin.diagnose(admin.Admin(worker_db)) if c.name == "autovacuum"]
    assert check.status == "warn"
    assert ("staged_jobs" if server_on else "on the server") in check.detail


def test_a_skewed_clock_is_warned_about(
    worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = doctor_module.time.time
    monkeypatch.setattr(doctor_module.time, "time", lambda: real() - 30)  # this host: behind
    [check] = [c for c in admin.diagnose(admin.Admin(worker_db)) if c.name == "clock"]
    assert check.status == "warn" and "behind" in check.detail and "NTP" in check.hint


def test_one_connection_answered_by_one_backend_is_no_pooler(worker_database_url: str) -> None:
    db = create_engine(worker_database_url)
    try:
        [check] = [c for c in admin.diagnose(admin.Admin(db)) if c.name == "pooler"]
    finally:
        db.dispose()
    assert check.status == "ok"


@pytest.mark.slow
def test_each_workers_last_pass_is_reported(
    worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import recoverypoint as rp
    from recoverypoint.jobs import InProcessBackend
    from recoverypoint.workers import Completer, Enqueuer, Reaper

    _, found = checks(worker_database_url, capsys)
    assert found["workers"]["status"] == "warn"
    assert "no completer pass ever" in found["workers"]["detail"]
    assert "recoverypoint worker all" in found["workers"]["hint"]

    engine = rp.Engine(worker_database_url, jobs=InProcessBackend())
    try:
        for worker in (Completer(engine), Enqueuer(engine), Reaper(engine)):
            one_recorded_pass(worker)
    finally:
        engine.dispose()
    _, found = checks(worker_database_url, capsys)
    assert found["workers"]["status"] == "ok", found["workers"]
    for kind in ("completer", "enqueuer", "reaper"):
        assert re.search(rf"{kind} [0-9]s ago", found["workers"]["detail"])

    db = create_engine(worker_database_url)
    try:
        with db.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE worker_passes SET last_pass_at = now() - interval '1 hour', "
                    "last_error = 'OperationalError: connection refused' WHERE worker = 'reaper'"
                )
            )
    finally:
        db.dispose()
    _, found = checks(worker_database_url, capsys)
    assert found["workers"]["status"] == "warn"
    assert "reaper late" in found["workers"]["detail"]
    assert "failing: OperationalError: connection refused" in found["workers"]["detail"]


@pytest.mark.slow
def test_a_worker_is_late_after_a_few_of_its_own_intervals(worker_db: sa.Engine) -> None:
    import recoverypoint as rp
    from recoverypoint.console import console
    from recoverypoint.workers import Completer

    engine = rp.Engine(worker_db)
    one_recorded_pass(Completer(engine), interval=5.0, jitter=0.5)
    ops = admin.Admin(worker_db)
    [recorded] = [w for k, w in admin.overview(ops).workers.items() if k == "completer"]
    assert recorded.interval_seconds == 5.5 and not recorded.late
    with worker_db.begin() as conn:  # a reaper of an older release: no interval recorded
        conn.execute(
            sa.text(
                "INSERT INTO worker_passes (worker, host, pid, last_pass_at) "
                "VALUES ('reaper', 'old-host', 1, now() - interval '60 seconds')"
            )
        )
    page = console(ops, authorize=lambda request, action: "ann")

    def badges() -> dict[str, str]:
        with TestClient(page) as browser:
            html = browser.get("/").text
        rows = re.findall(r"<td>(\w+)</td>\s*<td><span class=\"badge (\w+)\"", html)
        return dict(rows)

    assert badges() == {"completer": "ok", "enqueuer": "fail", "reaper": "ok"}
    with worker_db.begin() as conn:  # stopped a minute ago: 3 x 5.5 s + 30 s have passed
        conn.execute(
            sa.text(
                "UPDATE worker_passes SET last_pass_at = now() - interval '60 seconds' "
                "WHERE worker = 'completer'"
            )
        )
    assert badges() == {"completer": "fail", "enqueuer": "fail", "reaper": "ok"}
    [late] = [c for c in admin.diagnose(ops) if c.name == "workers"]
    assert "completer late" in late.detail and "reaper late" not in late.detail
