"""The operator's actions racing running requests and the completer: clients retry their
keys, the completer resumes them, an operator retries, releases, abandons and reopens
whatever it finds (unforced, as the CLI and the console do by default), all at once.
Whatever the interleaving, no foreign step runs twice for one key, and no answer a client
was given is lost or changed afterwards."""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from workload import Recorder, rows

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.workers import Completer

KEYS = 16
ROUNDS = 6


def charge(recorder: Recorder) -> rp.Operation[Any]:
    """reserved → charged (the foreign step: every call recorded) → finished, which raises
    every time for a key whose params say ``fail``."""
    op: rp.Operation[Any] = rp.Operation("charge")

    @op.atomic_phase("reserved")
    def reserve(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        pass

    @op.foreign_step("charged")
    def call(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        recorder.step_called(step.key_id)
        return {"charge": step.downstream_key()}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        if params.get("fail"):
            raise RuntimeError("the ledger refuses it")
        return rp.Response(201, {"charge": tx.state["charge"]})

    return op


@pytest.mark.slow
def test_no_action_races_a_request_into_a_second_effect_or_a_lost_answer(
    worker_db: sa.Engine,
) -> None:
    engine = rp.Engine(worker_db, retry_base=0.001, retry_cap=0.001)
    operation = charge(Recorder(worker_db))
    engine.register(operation)
    # Half the keys fail in the phase after the foreign step, every time: they are retried,
    # resumed, abandoned and reopened, and their step must still have run once.
    params = {f"k{n}": {"fail": n % 2 == 1} for n in range(KEYS)}
    answers: dict[str, list[tuple[int, Any]]] = {key: [] for key in params}
    done = threading.Event()
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(ROUNDS):
            for key in pick.sample(list(params), len(params)):
                try:
                    outcome = engine.run(operation, key=key, params=params[key])
                except (rp.IdempotencyError, RuntimeError):
                    continue  # in use, or the failing phase: a client retries later
                answers[key].append((outcome.status, outcome.body))

    def operator(seed: int) -> None:
        pick = random.Random(seed)
        ops = admin.Admin(worker_db, actor="racer@test")  # knows no operation
        actions = [admin.retry, admin.release, admin.abandon, admin.reopen]
        while not done.is_set():
            ids = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
            if not ids:
                continue
            with contextlib.suppress(admin.Refused, admin.NotFound):
                pick.choice(actions)(ops, pick.choice(ids))

    def completer() -> None:
        worker = Completer(engine, min_age=0)
        while not done.is_set():
            worker.run_once()

    def guarded(target: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:  # reported below
                errors.append(exc)

        return threading.Thread(target=run)

    clients = [guarded(client, seed) for seed in range(3)]
    background = [guarded(operator, 10), guarded(operator, 11), guarded(completer)]
    for thread in [*clients, *background]:
        thread.start()
    for thread in clients:
        thread.join()
    done.set()
    for thread in background:
        thread.join()
    assert not errors, errors

    calls = rows(worker_db, "SELECT key_id, count(*) AS n FROM step_calls GROUP BY key_id")
    assert calls and all(c.n == 1 for c in calls), [tuple(c) for c in calls if c.n != 1]
    stored = {
        r.idempotency_key: (r.response_status, r.response_body)
        for r in rows(worker_db, "SELECT * FROM idempotency_keys")
    }
    for key, seen in answers.items():
        # A charge a client was told of is the one its key keeps, and every replay's.
        # (Abandoned answers are the operator's to replace: reopen does just that.)
        charged = [answer for answer in seen if answer[0] == 201]
        assert all(answer == charged[0] for answer in charged), (key, seen)
        if charged:
            assert stored[key] == charged[0], (key, charged[0], stored[key])
    assert any(answers.values()), "no client got an answer: the race raced nothing"


@pytest.mark.parametrize("action", ["retry", "release", "abandon", "reopen", "delete"])
@pytest.mark.slow
def test_an_action_taken_while_the_step_runs_neither_repeats_it_nor_loses_its_answer(
    worker_db: sa.Engine, action: str
) -> None:
    """The interleaving the race above can only hope for, made certain: while the foreign
    step is in its call, the operator acts on the key (unforced, knowing no operation),
    another client retries it and the completer makes a pass; none of them gets the key."""
    engine = rp.Engine(worker_db, retry_base=0.001, retry_cap=0.001)
    seen: list[str] = []

    def meanwhile() -> None:
        if seen:
            seen.append("a second call")  # a takeover ran the step again: fails below
            return
        [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
        try:
            getattr(admin, action)(admin.Admin(worker_db), key_id)
            seen.append("done")
        except admin.Refused:
            seen.append("refused")
        with pytest.raises(rp.KeyInUse):
            engine.run(operation, key="k", params={})
        passed = Completer(engine, min_age=0).run_once()
        assert (passed.finished, passed.failed, passed.abandoned) == (0, 0, 0)

    operation = charge(Recorder(worker_db, on_step=meanwhile))
    engine.register(operation)
    first = engine.run(operation, key="k", params={})
    # retry only makes the key due: harmless while its lease is live, so it is not refused.
    assert seen == ["done" if action == "retry" else "refused"] and first.status == 201
    again = engine.run(operation, key="k", params={})
    assert again.replayed and (again.status, again.body) == (first.status, first.body)
    assert rows(worker_db, "SELECT count(*) AS n FROM step_calls")[0].n == 1


@pytest.mark.parametrize("action", ["abandon", "reopen"])
@pytest.mark.slow
def test_a_finished_answer_is_never_replaced(worker_db: sa.Engine, action: str) -> None:
    engine = rp.Engine(worker_db)
    operation = charge(Recorder(worker_db))
    engine.register(operation)
    first = engine.run(operation, key="k", params={})
    [key_id] = [r.id for r in rows(worker_db, "SELECT id FROM idempotency_keys")]
    ops = admin.Admin(worker_db)
    with pytest.raises(admin.Refused):
        getattr(admin, action)(ops, key_id)
    again = engine.run(operation, key="k", params={})
    assert again.replayed and (again.status, again.body) == (first.status, first.body)
