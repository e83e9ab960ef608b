"""A lease is judged by its holder's own lock timeout, stored with it by the claim: no
operator path (the library, the CLI, the console; with the operations known or not)
calls a live lease expired, so none of them lets a second request take a key whose
foreign step is running, or stores an answer over the one that step is about to give."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import client
from test_admin import EXPIRED, OVERDUE, key, plant
from workload import Recorder, rows, steps_operation

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.admin import key_actions
from recoverypoint.cli import main
from recoverypoint.console import console
from recoverypoint.exits import EXIT_OK, EXIT_REFUSED

TEN_MINUTES = timedelta(minutes=10)
# A lease taken before migration 0010: no lock timeout stored with it.
UNJUDGED = {"locked_at": "now() - interval '5 minutes'", "lock_token": "gen_random_uuid()"}


class Held:
    """A request whose foreign step has begun its call and waits until released."""

    def __init__(self, worker_db: sa.Engine) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.engine = rp.Engine(worker_db)
        recorder = Recorder(worker_db, on_step=self._call)
        self.operation = steps_operation("slow_charge", recorder, lock_timeout=TEN_MINUTES)
        self.engine.register(self.operation)
        self.outcome: list[rp.Outcome] = []
        self.thread = threading.Thread(target=self._run)

    def _call(self) -> None:
        self.entered.set()
        assert self.go.wait(120), "the test never let the step finish"

    def _run(self) -> None:
        self.outcome.append(self.engine.run(self.operation, key="k", params={}))


@pytest.fixture
def held(worker_db: sa.Engine) -> Iterator[Held]:
    request = Held(worker_db)
    request.thread.start()
    assert request.entered.wait(60), "the foreign step never started"
    # 100 s into the call: past the 90 s every unknown operation was once judged by.
    with worker_db.begin() as conn:
        conn.execute(sa.text("UPDATE idempotency_keys SET locked_at = now() - interval '100 s'"))
    try:
        yield request
    finally:
        request.go.set()
        request.thread.join(60)


@pytest.mark.slow
def test_a_running_ten_minute_lease_is_live_for_every_operator_path(
    held: Held, worker_db: sa.Engine, worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
    token = key(worker_db, key_id).lock_token
    url = ["--database-url", worker_database_url]

    # The CLI without --app: the listing, then each action that would end the lease.
    assert main(["keys", "list", *url, "--json"]) == EXIT_OK
    out = capsys.readouterr().out
    [row] = admin.list_keys(admin.Admin(worker_db), admin.KeyFilter(ids=(key_id,)))
    assert (row.state, row.lock_timeout, row.live) == ("in-flight", 600.0, True)
    assert 490 < (row.lease_left or 0) <= 500 and '"state": "in-flight"' in out
    assert main(["keys", "list", *url]) == EXIT_OK
    assert re.search(r"in-flight .* 8m[012]\ds ", capsys.readouterr().out)  # left, of 10m
    assert main(["keys", "release", str(key_id), *url]) == EXIT_REFUSED
    assert main(["keys", "abandon", str(key_id), "--yes", *url]) == EXIT_REFUSED
    assert re.search(r"live lease \((49\d|500)s left", capsys.readouterr().err)

    # The console, built on an Admin that knows no operation.
    app = console(admin.Admin(worker_db, via="console"), authorize=lambda r, a: "operator")
    with client(app) as browser:
        page = browser.get(f"/keys/{key_id}")
        assert page.status_code == 200 and "left" in page.text and "expired" not in page.text
        for action in ("release", "abandon"):
            assert browser.get(f"/keys/{key_id}/{action}").status_code == 409
            form = {"csrf": browser.cookies["rp_console_csrf"]}
            sent = browser.post(f"/keys/{key_id}/{action}", data=form)
            assert sent.status_code == 409, sent.text[-400:]

    after = key(worker_db, key_id)
    assert (after.lock_token, after.finished_at) == (token, None)
    held.go.set()
    held.thread.join(60)
    assert held.outcome[0].status == 201
    assert rows(worker_db, "SELECT count(*) AS n FROM step_calls")[0].n == 1


@pytest.mark.slow
def test_every_claim_stores_the_lock_timeout_it_judges_its_lease_by(
    held: Held, worker_db: sa.Engine
) -> None:
    assert [r.lock_timeout for r in rows(worker_db, "SELECT * FROM idempotency_keys")] == [600.0]


@pytest.mark.slow
def test_a_lease_taken_before_0010_is_live_unless_its_operation_is_known(
    worker_db: sa.Engine, worker_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row without a stored timeout may be held by a process of the previous release:
    its deadline is the operation's, and nobody who does not know the operation may call
    it expired."""
    [old] = plant(worker_db, "slow", **UNJUDGED, **OVERDUE)
    bare = admin.Admin(worker_db)
    [row] = admin.list_keys(bare, admin.KeyFilter(ids=(old,)))
    assert (row.state, row.lock_timeout, row.lease_left) == ("in-flight", None, None)
    with pytest.raises(admin.Refused, match="deadline is unknown"):
        admin.release(bare, old)
    assert main(["keys", "list", "--database-url", worker_database_url]) == EXIT_OK
    assert "unknown" in capsys.readouterr().out
    # Known here, the operation's own timeout judges it: ten minutes, still live...
    slow: rp.Operation[Any] = rp.Operation("slow", lock_timeout=TEN_MINUTES)
    [row] = admin.list_keys(admin.Admin(worker_db, (slow,)), admin.KeyFilter(ids=(old,)))
    assert (row.state, row.lock_timeout) == ("in-flight", 600.0)
    # ... and a minute: expired, released without --force.
    quick: rp.Operation[Any] = rp.Operation("slow", lock_timeout=timedelta(minutes=1))
    assert admin.release(admin.Admin(worker_db, (quick,)), old).changed == (old,)


@pytest.mark.slow
def test_the_stored_timeout_wins_over_the_operation_known_here(worker_db: sa.Engine) -> None:
    """An operator's --app may be another release than the holder's: the holder decides."""
    [key_id] = plant(worker_db, "slow", **EXPIRED, **OVERDUE)  # 90 s, taken an hour ago
    slow: rp.Operation[Any] = rp.Operation("slow", lock_timeout=timedelta(hours=2))
    [row] = admin.list_keys(admin.Admin(worker_db, (slow,)), admin.KeyFilter(ids=(key_id,)))
    assert (row.state, row.lock_timeout, row.live) == ("stuck", 90.0, False)


@pytest.mark.slow
def test_an_action_leaves_a_lease_its_holder_renewed_since_it_was_read(
    worker_db: sa.Engine,
) -> None:
    """The fence's other half: the token is the same, but a phase committed meanwhile and
    renewed the lease; the UPDATE judges it live again, as the holder does."""
    ops = admin.Admin(worker_db)
    [key_id] = plant(worker_db, **EXPIRED, **OVERDUE)
    # Unmasked, as the actions read it: each statement names the key's scope.
    [seen] = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)), reveal=True)
    assert seen.state == "stuck"
    with worker_db.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET locked_at = now() WHERE id = :i"), {"i": key_id}
        )
    before = key(worker_db, key_id)
    for statement, params in [
        (key_actions._RELEASE, {"force": False}),
        (key_actions._ABANDON, {"force": False, "status": 500, "body": "{}"}),
    ]:
        changed, _ = key_actions._apply(ops, "keys.test", statement, [seen], params, matched=1)
        assert changed == ()
    assert key(worker_db, key_id) == before


@pytest.mark.slow
def test_a_takeover_stores_its_own_lock_timeout(worker_db: sa.Engine) -> None:
    """A lease taken over by id (a retry, the completer) is judged by its new holder's
    timeout, here on a row a holder of the previous release left with none."""
    judged: list[tuple[str, float | None]] = []

    def call() -> None:
        if not judged:
            judged.append(("down", None))
            raise RuntimeError("provider down")
        [row] = admin.list_keys(admin.Admin(worker_db), admin.KeyFilter())
        judged.append((row.state, row.lock_timeout))

    engine = rp.Engine(worker_db)
    operation = steps_operation("slow_charge", Recorder(worker_db, call), lock_timeout=TEN_MINUTES)
    engine.register(operation)
    with pytest.raises(RuntimeError, match="provider down"):
        engine.run(operation, key="k", params={})
    with worker_db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET lock_timeout = NULL, lock_token = gen_random_uuid(), "
                "locked_at = now() - interval '1 hour'"
            )
        )
    assert engine.run(operation, key="k", params={}).status == 201
    assert judged == [("down", None), ("in-flight", 600.0)]


@pytest.mark.parametrize(
    ("statement", "params"),
    [
        (key_actions._RELEASE, {"force": True}),
        (key_actions._ABANDON, {"force": True, "status": 500, "body": "{}"}),
        (key_actions._DELETE, {"force": True}),
    ],
    ids=["release", "abandon", "delete"],
)
@pytest.mark.slow
def test_a_forced_action_leaves_a_lease_taken_over_since_it_was_read(
    worker_db: sa.Engine, statement: sa.TextClause, params: dict[str, Any]
) -> None:
    """Force overrides a live lease the operator saw, never one that changed hands since:
    a retry (or the completer) that took the key over after the read is not the holder the
    operator chose to cut off, and its run must not lose its lease, its key or its answer."""
    ops = admin.Admin(worker_db)
    [key_id] = plant(worker_db, **EXPIRED, **OVERDUE)
    [seen] = admin.list_keys(ops, admin.KeyFilter(ids=(key_id,)), reveal=True)
    with worker_db.begin() as conn:  # a retry takes the key over: a new token, a fresh lease
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET locked_at = now(), lock_token = gen_random_uuid() "
                "WHERE id = :i"
            ),
            {"i": key_id},
        )
    before = key(worker_db, key_id)
    changed, _ = key_actions._apply(ops, "keys.test", statement, [seen], params, matched=1)
    assert changed == ()
    assert key(worker_db, key_id) == before
