"""An observer never changes an outcome. One that raises at any hook (a metrics push or a
trace exporter down), from an event or from entering or leaving a scope, or that tries to
swallow the work's error, leaves every run, retry and worker pass exactly as an engine
without it would: the foreign step runs once per key, the answer is the same, and the
failure is logged once per observer, hook and kind of error, not once per request."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import JOB, Recorder, rows, steps_operation

import recoverypoint as rp
from recoverypoint.jobs import InProcessBackend, Job, consume_once
from recoverypoint.observe import Observer, RunObservation, combine
from recoverypoint.workers import Completer, Enqueuer

# Every place an observer is called: an event, a scope made, entered or left; "…swallow"
# is a scope that tries to swallow the work's error (its __exit__ returns True).
HOOKS = (
    "run",
    "run.enter",
    "run.exit",
    "run.swallow",
    "claimed",
    "phase",
    "phase.enter",
    "phase.exit",
    "phase.swallow",
    "finished",
    "trace_context",
    "job_staged",
    "serialization_retry",
    "publishing",
    "publishing.enter",
    "publishing.exit",
    "job_published",
    "job_publish_failed",
    "key_abandoned",
    "key_compensated",
    "worker_pass",
    "reaped",
    "consuming",
    "consuming.enter",
    "consuming.exit",
    "consumed",
)


class ObserverDown(Exception):
    pass


class Failing(Observer):
    """Raises at every hook in ``failing``; records every hook it heard."""

    def __init__(self, failing: frozenset[str] | set[str]) -> None:
        self.failing = frozenset(failing)
        self.heard: list[str] = []

    def hook(self, name: str) -> None:
        self.heard.append(name)
        if name in self.failing:
            raise ObserverDown(f"observer down at {name}")

    def scope(self, name: str) -> AbstractContextManager[object]:
        self.hook(name)
        return _Scope(self, name)

    def run(self, operation: str, version: int, *, by: str, scope: Any, key: Any) -> Any:
        self.hook("run")
        return _Run(self)

    def serialization_retry(self, attempt: int, sqlstate: str | None) -> None:
        self.hook("serialization_retry")

    def trace_context(self) -> str | None:
        self.hook("trace_context")
        return None

    def job_staged(self, operation: str, job: str) -> None:
        self.hook("job_staged")

    def publishing(self, job: str, job_key: str, trace_context: str | None) -> Any:
        return self.scope("publishing")

    def job_published(self, job: str, lag: float) -> None:
        self.hook("job_published")

    def job_publish_failed(self, job: str) -> None:
        self.hook("job_publish_failed")

    def key_abandoned(self, operation: str) -> None:
        self.hook("key_abandoned")

    def key_compensated(self, operation: str, ok: bool) -> None:
        self.hook("key_compensated")

    def reaped(self, finished: int, abandoned: int, messages: int) -> None:
        self.hook("reaped")

    def worker_pass(self, worker: str) -> None:
        self.hook("worker_pass")

    def consuming(self, consumer: str, message_id: str, trace_context: str | None) -> Any:
        return self.scope("consuming")

    def consumed(self, consumer: str, processed: bool) -> None:
        self.hook("consumed")


class _Scope(AbstractContextManager[object]):
    def __init__(self, observer: Failing, name: str) -> None:
        self.observer, self.name = observer, name

    def __enter__(self) -> object:
        self.observer.hook(f"{self.name}.enter")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.observer.hook(f"{self.name}.exit")
        return f"{self.name}.swallow" in self.observer.failing


class _Run(RunObservation):
    def __init__(self, observer: Failing) -> None:
        self.observer = observer
        self.scope = _Scope(observer, "run")

    def __enter__(self) -> Any:
        self.scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.scope.__exit__(*exc)

    def claimed(self, key_id: int, point: str, attempt: int, new: bool) -> None:
        self.observer.hook("claimed")

    def phase(self, point: str, atomic: bool) -> Any:
        return self.observer.scope("phase")

    def finished(self, outcome: rp.Outcome) -> Any:
        self.observer.hook("finished")
        return rp.Outcome(500, "changed by the observer", {}, False)


def step_calls(db: sa.Engine, key_id: int) -> int:
    return len(rows(db, "SELECT 1 FROM step_calls WHERE key_id = :k", k=key_id))


def key_row(db: sa.Engine, scope: str, key: str) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text("SELECT * FROM idempotency_keys WHERE scope = :s AND idempotency_key = :k"),
            {"s": scope, "k": key},
        ).one()


@pytest.fixture
def quiet_observer_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    from recoverypoint import observe

    observe._reported.clear()  # each test sees its own first failures logged
    yield
    observe._reported.clear()


ISOLATION = settings(
    database=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@ISOLATION
@given(failing=st.sets(st.sampled_from(HOOKS)), fail_step=st.booleans())
@pytest.mark.slow
def test_an_observer_failing_at_any_hook_changes_no_run(
    worker_db: sa.Engine, failing: set[str], fail_step: bool
) -> None:
    """Three calls with one key, the foreign step failing on the first if ``fail_step``:
    the step's error (never the observer's) on that one, then one charge, one answer."""
    observer = Failing(failing)
    card_down = [fail_step]

    def on_step() -> None:
        if card_down[0]:
            card_down[0] = False
            raise ConnectionError("card network down")

    engine = rp.Engine(worker_db, observer=observer, retry_base=0.0)
    engine.register(steps_operation("charges", Recorder(worker_db, on_step=on_step)))
    scope, key = uuid.uuid4().hex, "k1"
    if fail_step:
        with pytest.raises(ConnectionError):
            engine.run(engine.operation("charges", 1), key=key, params={}, scope=scope)
    outcomes = [
        engine.run(engine.operation("charges", 1), key=key, params={}, scope=scope)
        for _ in range(3)
    ]
    row = key_row(worker_db, scope, key)
    assert step_calls(worker_db, row.id) == 1 + fail_step
    assert [(o.status, o.replayed) for o in outcomes] == [(201, False), (201, True), (201, True)]
    assert len({repr(o.body) for o in outcomes}) == 1
    assert row.response_status == 201
    assert row.attempts == 1 + fail_step  # counted by each claim
    # It was called all along (a run's hooks only if the run could be observed), and a
    # scope it failed to enter was never left.
    assert "job_staged" in observer.heard
    assert ("phase" in observer.heard) is ("run" not in failing)
    for scope in ("run", "phase"):
        if f"{scope}.enter" in failing:
            assert f"{scope}.exit" not in observer.heard


def test_an_observer_failing_as_the_step_closes_charges_once(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture, quiet_observer_log: None
) -> None:
    """The issue's report: a metrics observer that fails as the step's scope closes; three
    calls used to charge three times. Its failure is logged once, not once per call."""
    engine = rp.Engine(worker_db, observer=Failing({"phase.exit"}))
    engine.register(steps_operation("charges", Recorder(worker_db)))
    for _ in range(3):
        scope = uuid.uuid4().hex
        for _call in range(3):
            outcome = engine.run(engine.operation("charges", 1), key="k", params={}, scope=scope)
            assert outcome.status == 201
        assert step_calls(worker_db, key_row(worker_db, scope, "k").id) == 1
    logged = [r for r in caplog.records if "observer Failing failed in phase" in r.getMessage()]
    assert len(logged) == 1


def test_an_observer_failing_on_the_async_engine_changes_no_run(
    worker_database_url: str, worker_db: sa.Engine
) -> None:
    async def main() -> list[rp.Outcome]:
        engine = rp.AsyncEngine(worker_database_url, observer=Failing(set(HOOKS)))
        recorder = Recorder(worker_db)
        op: rp.Operation[Any] = rp.Operation("async_charges")

        @op.foreign_step("charged")
        async def charge(step: rp.StepContext, params: Any) -> dict[str, Any]:
            recorder.step_called(step.key_id)
            return {"charge": step.downstream_key()}

        @op.atomic_phase("finished")
        async def finish(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
            tx.stage_job(JOB, {"key_id": tx.key_id})
            return rp.Response(201, {"charge": tx.state["charge"]})

        engine.register(op)
        try:
            return [await engine.run(op, key="k", params={}, scope="async") for _ in range(3)]
        finally:
            await engine.dispose()

    outcomes = asyncio.run(main())
    assert [o.status for o in outcomes] == [201, 201, 201]
    assert step_calls(worker_db, key_row(worker_db, "async", "k").id) == 1


def test_observers_combined_each_hear_every_event_whatever_another_raises(
    worker_db: sa.Engine,
) -> None:
    alone, first, second = Failing(set()), Failing(set(HOOKS) - {"run"}), Failing(set())
    for scope, observer in (("alone", alone), ("combined", combine(first, second))):
        engine = rp.Engine(worker_db, observer=observer)
        engine.register(steps_operation("charges", Recorder(worker_db)))
        engine.run(engine.operation("charges", 1), key="k", params={}, scope=scope)
    assert second.heard == alone.heard
    assert {"run", "claimed", "phase.enter", "phase.exit", "finished", "job_staged"} <= set(
        second.heard
    )


def test_the_workers_and_consume_once_carry_on_past_a_failing_observer(
    worker_db: sa.Engine,
) -> None:
    published: list[Job] = []
    observer = Failing(set(HOOKS))
    engine = rp.Engine(worker_db, observer=observer, jobs=InProcessBackend({JOB: published.append}))
    recorder = Recorder(worker_db, on_step=lambda: None)
    engine.register(steps_operation("charges", recorder))
    scope = uuid.uuid4().hex
    engine.run(engine.operation("charges", 1), key="k", params={}, scope=scope)
    result = Enqueuer(engine).run_once()
    assert result.published == 1
    assert len(published) == 1
    assert Completer(engine).run_once() is not None
    with worker_db.begin() as conn:
        assert consume_once(conn, "receipt", published[0].job_key, observer=observer)
    with worker_db.begin() as conn:
        assert not consume_once(conn, "receipt", published[0].job_key, observer=observer)
    assert {"publishing", "job_published", "worker_pass", "consumed"} <= set(observer.heard)


def test_an_observer_that_does_not_fail_is_heard_with_no_failure_logged(
    worker_db: sa.Engine, caplog: pytest.LogCaptureFixture, quiet_observer_log: None
) -> None:
    observer = Failing(set())
    engine = rp.Engine(worker_db, observer=observer)
    engine.register(steps_operation("charges", Recorder(worker_db)))
    with caplog.at_level(logging.ERROR, logger="recoverypoint"):
        engine.run(engine.operation("charges", 1), key="k", params={}, scope="fine")
    assert not [r for r in caplog.records if "observer" in r.getMessage()]
    assert observer.heard[:3] == ["run", "run.enter", "claimed"]


def test_a_trace_context_that_is_not_text_is_not_stored(worker_db: sa.Engine) -> None:
    """What an observer returns is checked too: anything but text would fail the COMMIT of
    the phase that stages a job."""

    class Odd(Observer):
        def trace_context(self) -> Any:
            return 42

    engine = rp.Engine(worker_db, observer=Odd())
    engine.register(steps_operation("charges", Recorder(worker_db)))
    outcome = engine.run(engine.operation("charges", 1), key="k", params={}, scope="odd")
    assert outcome.status == 201
    [job] = rows(worker_db, "SELECT trace_context FROM staged_jobs")
    assert job.trace_context is None
