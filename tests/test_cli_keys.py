"""``recoverypoint keys|jobs`` end to end, through ``recoverypoint.cli.main`` on a real
database: each command finds, shows and changes exactly the rows it says, refuses what it
must with one line on stderr and its exit status, and behaves in a pipe."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from typing import Any

import pytest
import sqlalchemy as sa
from test_admin import ABANDONED, EXPIRED, FINISHED, LIVE, OVERDUE, WAITING, key, plant, snapshot
from workload import Recorder, rows, stage_jobs, steps_operation

import recoverypoint as rp
from recoverypoint.cli import main
from recoverypoint.exits import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, EXIT_USAGE

COLUMNS = ["id", "operation", "scope", "key", "recovery point", "state", "attempts", "next attempt",
           "lease left", "status", "age", "last error"]  # fmt: skip


@pytest.fixture(autouse=True)
def database(worker_database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", worker_database_url)
    return worker_database_url


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    status, out, err = run(capsys, *args, "--json")
    assert status == EXIT_OK, err
    return json.loads(out)


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if "event=" not in line]
    [line] = lines
    assert line.startswith(f"recoverypoint {command}: error: ")
    return line


@pytest.fixture
def app(worker_db: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> rp.Engine:
    """``--app rp_cli_test_app:engine``: an engine knowing the ``steps`` operation."""
    engine = rp.Engine(worker_db)
    engine.register(steps_operation("steps", Recorder(worker_db)))
    module = types.ModuleType("rp_cli_test_app")
    module.engine = engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rp_cli_test_app", module)
    return engine


# -- list, show, stats ---------------------------------------------------------------------


def test_list_prints_the_columns_and_the_filters_select(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    stuck = plant(worker_db, "a", 2, last_error="'RuntimeError: card network down'", **OVERDUE)
    plant(worker_db, "b", 1, **FINISHED)

    status, out, _ = run(capsys, "keys", "list", "--state", "stuck")

    assert status == EXIT_OK
    header, *lines = out.splitlines()
    assert header.split("  ")[0] == "id" and [c for c in COLUMNS if c not in header] == []
    assert [int(line.split()[0]) for line in lines] == list(reversed(stuck))
    assert all("a@1" in line and "stuck" in line and "card network down" in line
               for line in lines)  # fmt: skip
    found = run_json(capsys, "keys", "list", "--operation", "b")
    assert [(k["operation"], k["state"], k["status"]) for k in found] == [("b", "finished", 201)]
    assert found[0]["scope"] != "planted"  # masked
    revealed = run_json(capsys, "keys", "list", "--operation", "b", "--reveal")
    assert revealed[0]["scope"] == "planted"


def test_the_same_key_of_two_customers_is_told_apart_by_its_scope(
    app: rp.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    for customer in ("alice", "bob"):
        app.run(app.operation("steps", 1), key="k1", scope=customer, params={"n": 1})

    _, out, _ = run(capsys, "keys", "list", "--reveal")
    header, *lines = out.splitlines()
    scopes = [line.split()[header.split().index("scope")] for line in lines]
    assert sorted(scopes) == ["alice", "bob"]
    _, masked, _ = run(capsys, "keys", "list")
    _, *masked_lines = masked.splitlines()
    assert len(set(masked_lines)) == 2 and "alice" not in masked and "bob" not in masked
    only_bob = run_json(capsys, "keys", "list", "--scope", "bob", "--reveal")
    assert [(k["scope"], k["key"]) for k in only_bob] == [("bob", "k1")]
    _, out, _ = run(capsys, "keys", "list", "--scope", "bob")
    assert len(out.splitlines()) == 2 and "bob" not in out  # filtered by it, shown masked


def test_show_explains_one_key(
    app: rp.Engine, worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = app.run(app.operation("steps", 1), key="k1", scope="alice", params={"n": 1})
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]

    status, out, _ = run(capsys, "keys", "show", str(key_id), "--app", "rp_cli_test_app:engine")

    assert status == EXIT_OK
    assert "finished" in out and "201" in out and outcome.body["charge"] in out
    assert "alice" not in out and '"n": "…#' in out  # scope and params masked
    by_name = run_json(capsys, "keys", "show", "--scope", "alice", "--operation", "steps",
                       "--key", "k1", "--reveal", "--app", "rp_cli_test_app:engine")  # fmt: skip
    assert by_name["row"]["id"] == key_id and by_name["request_params"] == {"n": 1}
    assert [p["point"] for p in by_name["phases"]] == ["started", "reserved", "charged", "finished"]
    assert [j["job_name"] for j in by_name["jobs"]] == ["notify"]
    status, out, _ = run(capsys, "keys", "show", str(key_id))
    assert "not known here; pass --app" in out


def test_show_of_a_missing_key_exits_3_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "keys", "show", "999")
    assert status == EXIT_NOT_FOUND and out == ""
    assert "there is no key 999" in one_error_line(err, "keys show")


def test_stats(worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    plant(worker_db, "a", 2, **OVERDUE)
    plant(worker_db, "a", 1, **ABANDONED)
    figures = run_json(capsys, "keys", "stats")
    assert figures["by_state"]["stuck"] == 2 and figures["by_state"]["abandoned"] == 1
    status, out, _ = run(capsys, "keys", "stats")
    assert status == EXIT_OK and "a@1" in out and "oldest unfinished" in out


# -- actions -------------------------------------------------------------------------------


def test_retry_one_key_changes_that_row_alone_and_logs_it(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    [target, _] = plant(worker_db, count=2, **WAITING)
    before = snapshot(worker_db)

    status, out, err = run(capsys, "keys", "retry", str(target), "--reset-attempts")

    assert (status, out) == (EXIT_OK, f"retried key {target}: next attempt now\n")
    changed = {i for i in before if before[i] != snapshot(worker_db)[i]}
    assert changed == {target}
    assert "event=keys.retry actor=" in err and f"ids={target}" in err


def test_a_bulk_action_needs_yes_and_dry_run_changes_nothing(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    stuck = plant(worker_db, "a", 3, **OVERDUE)
    plant(worker_db, "b", 2, **OVERDUE)
    before = snapshot(worker_db)

    status, _, err = run(capsys, "keys", "retry", "--operation", "a")
    assert status == EXIT_USAGE and "--yes" in one_error_line(err, "keys retry")
    status, out, _ = run(capsys, "keys", "retry", "--operation", "a", "--dry-run")
    assert status == EXIT_OK and out.startswith("dry run: would retry 3 of 3 selected keys")
    assert all(str(i) in out for i in stuck)
    assert snapshot(worker_db) == before
    status, _, err = run(capsys, "keys", "retry")
    assert status == EXIT_USAGE and "filters" in err

    result = run_json(capsys, "keys", "retry", "--operation", "a", "--yes")

    assert sorted(result["changed"]) == stuck
    after = snapshot(worker_db)
    assert {i for i in before if before[i] != after[i]} == set(stuck)


def test_release_of_a_live_lease_is_refused_without_force(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    [live] = plant(worker_db, **LIVE)
    [expired] = plant(worker_db, **EXPIRED)

    status, out, err = run(capsys, "keys", "release", str(live))

    assert status == EXIT_REFUSED and out == ""
    line = one_error_line(err, "keys release")
    assert "live lease" in line and "--force" in line and "LockLost" in line
    assert key(worker_db, live).lock_token is not None
    assert run(capsys, "keys", "release", str(expired))[0] == EXIT_OK
    assert run(capsys, "keys", "release", str(live), "--force")[0] == EXIT_OK
    assert key(worker_db, live).lock_token is None and key(worker_db, expired).lock_token is None
    status, _, err = run(capsys, "keys", "release", str(live))
    assert status == EXIT_REFUSED and "no lease" in err


def test_abandon_stores_the_response_given(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    [target, other] = plant(worker_db, count=2, **OVERDUE)
    status, _, _ = run(capsys, "keys", "abandon", str(target), "--response-status", "410",
                       "--message", "gone for good")  # fmt: skip
    assert status == EXIT_OK
    row = key(worker_db, target)
    assert (row.response_status, row.response_body["message"]) == (410, "gone for good")
    assert row.abandoned_at is not None and key(worker_db, other).finished_at is None
    status, _, err = run(capsys, "keys", "abandon", str(target))
    assert status == EXIT_REFUSED and "already abandoned" in err


def test_reopen_asks_for_confirmation(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    [target] = plant(worker_db, attempts="10", point="charged", **ABANDONED)

    status, _, err = run(capsys, "keys", "reopen", str(target))  # stdin is not a terminal
    assert status == EXIT_USAGE and "--yes" in err
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    status, _, err = run(capsys, "keys", "reopen", str(target))
    assert status == EXIT_REFUSED and "not confirmed" in err
    assert key(worker_db, target).abandoned_at is not None

    assert run(capsys, "keys", "reopen", str(target), "--yes")[0] == EXIT_OK
    row = key(worker_db, target)
    assert (row.abandoned_at, row.finished_at, row.attempts) == (None, None, 0)


def test_delete_and_purge(worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    [done] = plant(worker_db, **FINISHED)
    [unfinished] = plant(worker_db, **OVERDUE)
    old = plant(worker_db, count=2, finished_at="now() - interval '4 days'", response_status="200")

    assert run(capsys, "keys", "delete", str(done))[0] == EXIT_OK
    status, _, err = run(capsys, "keys", "delete", str(unfinished))
    assert status == EXIT_REFUSED and "--force" in err
    status, _, err = run(capsys, "keys", "purge", "--older-than", "3d")
    assert status == EXIT_USAGE and "--yes" in err
    status, out, _ = run(capsys, "keys", "purge", "--older-than", "3d", "--dry-run")
    assert out.startswith("dry run: would purge 2 of 2 selected keys")
    assert "planted" not in out  # the sample's scopes masked, as every listing's
    assert run_json(capsys, "keys", "purge", "--older-than", "3d", "--yes")["changed"] == old
    assert [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")] == [unfinished]


# -- jobs ------------------------------------------------------------------------------------


def test_jobs_list_show_retry_delete(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    stage_jobs(worker_db, 3)
    with worker_db.begin() as conn:
        conn.execute(sa.text(
            "UPDATE staged_jobs SET attempts = 2, last_error = 'broker down', "
            "next_attempt_at = now() + interval '1 hour' WHERE id = 1"
        ))  # fmt: skip
    listed = run_json(capsys, "jobs", "list")
    assert [j["id"] for j in listed] == [3, 2, 1]
    assert [j["id"] for j in run_json(capsys, "jobs", "list", "--failing")] == [1]
    assert run_json(capsys, "jobs", "show", "1")["last_error"] == "broker down"

    assert run(capsys, "jobs", "retry", "1", "--reset-attempts")[0] == EXIT_OK
    [job] = rows(worker_db, "SELECT attempts, next_attempt_at <= now() AS due FROM staged_jobs "
                            "WHERE id = 1")  # fmt: skip
    assert (job.attempts, job.due) == (0, True)
    status, _, err = run(capsys, "jobs", "delete", "--name", "notify")
    assert status == EXIT_USAGE and "--yes" in err
    assert run(capsys, "jobs", "delete", "2")[0] == EXIT_OK
    assert [r.id for r in rows(worker_db, "SELECT id FROM staged_jobs ORDER BY id")] == [1, 3]
    status, _, err = run(capsys, "jobs", "show", "2")
    assert status == EXIT_NOT_FOUND and "no staged job 2" in err


def test_a_job_being_published_is_left_alone(
    worker_db: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    stage_jobs(worker_db, 1)
    with worker_db.connect() as enqueuer:  # holds the row as an enqueuer publishing it does
        enqueuer.execute(sa.text("SELECT id FROM staged_jobs FOR UPDATE"))
        status, _, err = run(capsys, "jobs", "delete", "1")
        enqueuer.rollback()
    assert status == EXIT_REFUSED and "being published" in err
    assert rows(worker_db, "SELECT count(*) FROM staged_jobs") == [(1,)]


# -- errors and pipes ------------------------------------------------------------------------


def test_without_a_database_it_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RECOVERYPOINT_DATABASE_URL")
    status, _, err = run(capsys, "keys", "list")
    assert status == EXIT_USAGE and "--database-url" in one_error_line(err, "keys list")


def test_an_unreachable_database_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "keys", "list", "--database-url", "postgresql://127.0.0.1:1/x")
    assert status == EXIT_FAILED and "refused" in one_error_line(err, "keys list")


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    ["migrate --sql", "keys list --limit 3000", "keys list --limit 3000 --json"],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(
    worker_db: sa.Engine, database: str, command: str
) -> None:
    plant(worker_db, count=3000, **OVERDUE)
    result = subprocess.run(
        f"{sys.executable} -m recoverypoint {command} --database-url '{database}' | head -1"
        if command.startswith("keys")
        else f"{sys.executable} -m recoverypoint {command} | head -1",
        shell=True, capture_output=True, text=True, timeout=120,
        executable="/bin/bash",
    )  # fmt: skip
    assert result.stderr == "" and len(result.stdout.splitlines()) == 1
