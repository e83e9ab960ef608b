"""The loop every worker shares: how long it waits between passes, what it refuses, and
the one-line log events it writes. No database: the worker here does nothing."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import ClassVar

import pytest

import recoverypoint as rp
from recoverypoint.logfmt import logfmt
from recoverypoint.workers import Result, Worker


class WaitsRecorded(threading.Event):
    """Records each wait of the loop instead of waiting; the ``passes``-th one stops it."""

    def __init__(self, passes: int) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.passes = passes

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        if len(self.waits) == self.passes:
            self.set()
        return self.is_set()


@dataclass
class IdleResult(Result):
    did: int = 0


class Idle(Worker[IdleResult]):
    name: ClassVar[str] = "idle"
    default_batch_size: ClassVar[int] = 1
    default_interval: ClassVar[float] = 7.0

    def run_once(self) -> IdleResult:
        return IdleResult()


def idle(passes: int) -> tuple[Idle, WaitsRecorded]:
    stop = WaitsRecorded(passes)
    # No connection is made: the worker never touches the database.
    return Idle(rp.Engine("postgresql://127.0.0.1:1/x"), stop_event=stop), stop


def test_the_loop_waits_the_interval_plus_up_to_a_tenth_of_it() -> None:
    worker, stop = idle(passes=200)
    worker.run_forever(2.0)
    assert all(2.0 <= wait <= 2.2 for wait in stop.waits)
    assert len(set(stop.waits)) == 200 and max(stop.waits) > 2.15  # jittered over the range

    worker, stop = idle(passes=3)
    worker.run_forever()  # the worker's own default
    assert all(7.0 <= wait <= 7.7 for wait in stop.waits)

    worker, stop = idle(passes=3)
    worker.run_forever(2.0, jitter=0)
    assert stop.waits == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(("interval", "jitter"), [(0.0, 0.0), (0.0, None), (1.0, 0.0)])
def test_zero_is_a_valid_interval_and_jitter(interval: float, jitter: float | None) -> None:
    worker, stop = idle(passes=1)
    worker.run_forever(interval, jitter)
    assert stop.waits == [interval]


@pytest.mark.parametrize(("interval", "jitter"), [(-1.0, None), (1.0, -0.1), (-1.0, -1.0)])
def test_a_negative_interval_or_jitter_is_refused(interval: float, jitter: float | None) -> None:
    worker, _ = idle(passes=1)
    with pytest.raises(ValueError, match="idle: interval and jitter must be >= 0"):
        worker.run_forever(interval, jitter)


def test_a_failed_pass_is_one_error_line_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, _ = idle(passes=2)
    failures = [RuntimeError("first line\nsecond line")]

    def run_once() -> IdleResult:
        if failures:
            raise failures.pop()
        return IdleResult(did=1)

    worker.run_once = run_once  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="recoverypoint.workers"):
        worker.run_forever(0.0)

    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "event=started worker=idle interval=0.0 batch_size=1"
    assert messages[1] == 'event=error worker=idle error="RuntimeError: first line"'
    assert caplog.records[1].levelno == logging.ERROR
    exc_info = caplog.records[1].exc_info  # the traceback goes with it
    assert exc_info and exc_info[0] is RuntimeError
    assert messages[2].startswith("event=pass worker=idle batches=0 did=1 seconds=")
    assert messages[3] == "event=stopped worker=idle"
    assert len(messages) == 4


def test_logfmt_quotes_what_would_break_a_line() -> None:
    assert logfmt(a=1, b="x y", c="", d='say "hi"', e="a=b", f="1\n2", g="back\\slash") == (
        'a=1 b="x y" c="" d="say \\"hi\\"" e="a=b" f="1\\n2" g="back\\\\slash"'
    )
