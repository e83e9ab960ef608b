"""Concurrency for the engine's tests, spelled twice: asyncio's (``AEvent``, ``aspawn``,
``await_set``, ``ajoin``, ``agather``) for tests/test_engine_async.py, and the same names
without the ``a``, on threads, for tests/test_engine_sync.py, which tools/async_to_sync.py generates
from it by renaming them.

A spawned call takes the function and its arguments, not a coroutine: the sync twin must
start it in a thread of its own, not call it there and then.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

# How long a test waits for a spawned call before it fails instead of hanging: a thread,
# unlike a task, cannot be cancelled.
JOIN_TIMEOUT = 120.0

AEvent = asyncio.Event
Event = threading.Event


def aspawn(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> asyncio.Task[T]:
    """Start ``fn(*args, **kwargs)`` in a task of its own."""
    return asyncio.create_task(fn(*args, **kwargs))


def spawn(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Start ``fn(*args, **kwargs)`` in a thread of its own."""
    future: Future[T] = Future()

    def call() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # raised again by join()
            future.set_exception(exc)

    threading.Thread(target=call, daemon=True).start()
    return future


async def await_set(event: asyncio.Event) -> None:
    """Wait until ``event`` is set; fail after JOIN_TIMEOUT instead of hanging."""
    await asyncio.wait_for(event.wait(), JOIN_TIMEOUT)


def wait_set(event: threading.Event) -> None:
    """Wait until ``event`` is set; fail after JOIN_TIMEOUT instead of hanging."""
    if not event.wait(JOIN_TIMEOUT):
        raise TimeoutError(f"not set within {JOIN_TIMEOUT} s")


async def ajoin(task: asyncio.Task[T]) -> T:
    """What the spawned call returned; what it raised is raised here."""
    return await task


def join(future: Future[T]) -> T:
    """What the spawned call returned; what it raised is raised here."""
    return future.result(timeout=JOIN_TIMEOUT)


async def agather(*calls: Callable[[], Awaitable[T]]) -> list[T]:
    """Run every call at once; their results in order, or the first error."""
    return list(await asyncio.gather(*(call() for call in calls)))


def gather(*calls: Callable[[], T]) -> list[T]:
    """Run every call at once, each in a thread; their results in order, or the first error."""
    started = [spawn(call) for call in calls]
    return [join(future) for future in started]
