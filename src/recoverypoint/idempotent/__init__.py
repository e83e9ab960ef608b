"""``@idempotent``: any function, sync or async, runs once per idempotency key.

::

    @rp.idempotent(engine, key="order_id")
    def charge_order(order_id: str, amount: int) -> Receipt:
        return payments.charge(amount, idempotency_key=rp.downstream_key())

Each decorated function is an operation of two phases, as a single-step endpoint is:

1. ``called``, a foreign step, calls the function outside any transaction; its return
   value, as JSON, is committed with the recovery point;
2. ``finished``, an atomic phase, answers that value (it commits in the step's
   transaction).

Any value the return annotation describes is stored exactly, bytes included (see
:mod:`recoverypoint.idempotent.shape`); a return type that can never be stored (a socket,
a generator) is refused when the function is decorated. A value that still cannot be
stored (one its annotation does not describe, a lone surrogate) is found after the
function ran, its effect done: the key then finishes with that refusal, and every call with
the key raises :class:`AbandonedCall` saying so, without running the function again.

So a call gets what a request gets: the atomic claim, the lease, the fingerprint of its
arguments (the same key with other arguments raises :class:`~recoverypoint.ParamsMismatch`),
the scope, and replays: a finished key returns the stored value without calling the
function. A call while another holds the key raises :class:`~recoverypoint.KeyInUse`.

Failures are Stripe's: the function's exception propagates, the lease is released (the
attempt counted when the call claimed the key), nothing is stored, and the next call with
the key runs the function again. Hand the foreign system :func:`downstream_key` so that
the repeat is not a second charge: it is the same for every attempt of the key.

The function needs its live call, so only a call runs step 1: the completer, which has none,
gets :class:`~recoverypoint.Retryable` and backs off, and abandons the key after the
operation's ``max_attempts``, as does the call that would start one more (it and later
calls then raise :class:`AbandonedCall`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, cast, overload

from pydantic_core import PydanticSerializationError

from ..engine import Engine
from ..engine.context import StepContext
from ..engine.waits import wait_seconds
from ..errors import AbandonedCall, InvalidParams, ParamsMismatch, Retryable
from ..keys import chosen_scope
from ..leases import DEFAULT_LOCK_TIMEOUT
from ..logfmt import logfmt
from ..operation import FINISHED, AsyncRunner, NotFound, Operation, Outcome, Response
from .shape import JSON_TEXT, VALUE, ArgumentRule, ReturnNotStored, Shape, as_key_text

__all__ = ["AbandonedCall", "downstream_key", "idempotent"]

logger = logging.getLogger("recoverypoint")

P = ParamSpec("P")
R = TypeVar("R")

CALLED = "called"
_RETURNED = 200
_NOT_STORED = "not_stored"  # the state's name for the refusal of a return value
# A value stored as the text of its JSON is answered with this header, so that every call
# knows which form to rebuild it from.
_JSON_TEXT_HEADERS = {"content-type": "application/json"}


# The step the running function belongs to, for downstream_key(). A context variable: a
# sync function runs in its caller's thread, an async one in its caller's task.
_STEP: ContextVar[StepContext | None] = ContextVar("recoverypoint_step", default=None)


def downstream_key(name: str | None = None) -> str:
    """The idempotency key to hand a foreign system from inside an ``@idempotent`` function:
    the same for every attempt of the call's key, different for every other key. Pass
    ``name`` when the function makes several foreign calls."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(
            "downstream_key() has a value only inside a function decorated with "
            "@idempotent, while it runs"
        )
    return step.downstream_key(name)


class _Call:
    """One call of a decorated function, for its ``called`` step."""

    def __init__(self, operation: Operation[Any], args: Any, kwargs: Any) -> None:
        self.operation, self.args, self.kwargs = operation, args, kwargs
        self.entered = False


_CALL: ContextVar[_Call | None] = ContextVar("recoverypoint_call", default=None)


@overload
def idempotent(
    engine: Engine,
    *,
    key: ArgumentRule,
    scope: ArgumentRule | None = None,
    name: str | None = None,
    version: int = 1,
    lock_timeout: timedelta = ...,
    max_attempts: int = 10,
    retention: timedelta | None = None,
    exclude: Collection[str] = (),
    key_required: bool = True,
    on_replay: Callable[[Outcome], object] | None = None,
    wait: timedelta | float | None = None,
    dedupe_window: timedelta | None = None,
    reconcile: Callable[..., object] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def idempotent(
    engine: AsyncRunner,
    *,
    key: ArgumentRule,
    scope: ArgumentRule | None = None,
    name: str | None = None,
    version: int = 1,
    lock_timeout: timedelta = ...,
    max_attempts: int = 10,
    retention: timedelta | None = None,
    exclude: Collection[str] = (),
    key_required: bool = True,
    on_replay: Callable[[Outcome], object] | None = None,
    wait: timedelta | float | None = None,
    dedupe_window: timedelta | None = None,
    reconcile: Callable[..., object] | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]: ...


def idempotent(
    engine: Engine | AsyncRunner,
    *,
    key: ArgumentRule,
    scope: ArgumentRule | None = None,
    name: str | None = None,
    version: int = 1,
    lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
    max_attempts: int = 10,
    retention: timedelta | None = None,
    exclude: Collection[str] = (),
    key_required: bool = True,
    on_replay: Callable[[Outcome], object] | None = None,
    wait: timedelta | float | None = None,
    dedupe_window: timedelta | None = None,
    reconcile: Callable[..., object] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function once per idempotency key; see :mod:`recoverypoint.idempotent`.

    The arguments are the params: validated by their annotations (unannotated ones must be
    JSON), fingerprinted and stored; arguments that cannot be stored raise
    :class:`~recoverypoint.InvalidParams` and store nothing. The return value is stored as
    JSON by its annotation (a pydantic model, a dataclass...) and rebuilt as that type for
    every call, the first included.

    Parameters
    ----------
    engine:
        An :class:`~recoverypoint.Engine` for a sync function, an ``AsyncEngine`` for an
        ``async def`` one; the function's operation is registered with it.
    key:
        Where a call's key comes from: the name of an argument (a str or an int), or a
        callable given the call's arguments by name (defaults applied).
    scope:
        Where a call's scope comes from, as ``key``. Without it every key is in the one
        scope ``""``.
    name:
        The operation's stable name; by default the function's module and qualified name,
        so pass one if the function may be renamed or moved while keys are stored.
    version:
        As for :class:`~recoverypoint.Operation`.
    lock_timeout:
        How long after a call's process dies another call may take its key over; a live
        call keeps it (as for :class:`~recoverypoint.Operation`).
    max_attempts:
        As for :class:`~recoverypoint.Operation`.
    retention:
        As for :class:`~recoverypoint.Operation`.
    exclude:
        Arguments left out of the params (neither fingerprinted nor stored): a client, a
        Celery task's ``self``.
    key_required:
        With ``False``, a call whose key is ``None`` runs the function unprotected: called
        as it is, nothing stored, logged with the record field ``idempotency=unprotected``
        (:func:`downstream_key` has no value in it). By default such a call raises
        :class:`~recoverypoint.InvalidKey`.
    on_replay:
        Called with the :class:`~recoverypoint.Outcome` of every call answered from the
        stored value without running the function (``outcome.replayed`` is true), before
        the value is returned; the call's return type is unchanged.
    wait:
        How long a call that finds its key in use waits for the call that holds it (at
        most a minute; see :mod:`recoverypoint.engine.waits`): it then returns that call's
        value, or runs the function if that call failed. Without it, or when the wait runs
        out, it raises :class:`~recoverypoint.KeyInUse`.
    dedupe_window:
        How long the provider the function calls remembers an idempotency key (Stripe: 24
        hours), as for :meth:`~recoverypoint.Operation.foreign_step`: once that long has
        passed since a call with the key began, the function is never called blindly again
        for it.
    reconcile:
        Called instead of the function past ``dedupe_window``, with the call's arguments and
        :func:`downstream_key` as the function would see them: it asks the provider what the
        first call did and returns the function's value (found: it is stored and returned)
        or :data:`~recoverypoint.NotFound` (the function is called anew, with a fresh
        downstream key). It is ``async def`` for an ``async def`` function. Without it the
        call raises :class:`~recoverypoint.NeedsReconciliation` and the key waits for an
        operator (``recoverypoint keys reconcile``).
    """

    wait_seconds(wait)  # refused when decorating, not at the first call

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        is_async = inspect.iscoroutinefunction(fn)
        if is_async != inspect.iscoroutinefunction(getattr(engine, "run", None)):
            kind, needed = ("an async", "rp.AsyncEngine") if is_async else ("a sync", "rp.Engine")
            raise TypeError(
                f"@idempotent: {fn.__qualname__} is {kind} function, which needs {needed}, "
                f"not {type(engine).__name__}"
            )
        shape = Shape(fn, exclude)
        operation: Operation[Any] = Operation(
            name or f"{fn.__module__}.{fn.__qualname__}",
            params=shape.params,
            version=version,
            lock_timeout=lock_timeout,
            max_attempts=max_attempts,
            retention=retention,
        )
        calls = _Calls(fn, shape, operation, key, scope, key_required, on_replay, wait)
        if reconcile is not None and inspect.iscoroutinefunction(reconcile) != is_async:
            raise TypeError(
                f"@idempotent: the reconcile hook of {fn.__qualname__} must be "
                f"{'an async def' if is_async else 'a plain'} function, as the function is"
            )
        hook = None if reconcile is None else calls.reconciling(reconcile, is_async)
        step = operation.foreign_step(CALLED, dedupe_window=dedupe_window, reconcile=hook)
        # The answer sends no statement: its fence goes with the write that records it.
        answer = operation._declare(FINISHED, "atomic", (), sends_nothing=True)
        if is_async:
            step(calls.step_async)
            answer(_finish_async)
        else:
            step(calls.step)
            answer(_finish)
        engine.register(operation)
        wrapper = (
            calls.async_wrapper(cast(AsyncRunner, engine))
            if is_async
            else calls.wrapper(cast(Engine, engine))
        )
        wrapper.operation = operation  # type: ignore[attr-defined]  # for tests and workers
        return wrapper

    return decorate


class _Calls:
    """A decorated function's calls: from the arguments to the engine and back."""

    def __init__(
        self,
        fn: Callable[..., Any],
        shape: Shape,
        operation: Operation[Any],
        key: ArgumentRule,
        scope: ArgumentRule | None,
        key_required: bool,
        on_replay: Callable[[Outcome], object] | None,
        wait: timedelta | float | None,
    ) -> None:
        self.fn, self.shape, self.operation = fn, shape, operation
        self.key = shape.rule(key, "key")
        self.scope = None if scope is None else shape.rule(scope, "scope")
        self.key_required = key_required
        self.on_replay = on_replay
        self.wait = wait

    def wrapper(self, engine: Engine) -> Callable[..., Any]:
        @functools.wraps(self.fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            call, run = self.request(args, kwargs)
            if run is None:
                return self.fn(*args, **kwargs)
            with self.calling(call):
                outcome = engine.run(self.operation, **run)
            return self.returned(outcome)

        return call

    def async_wrapper(self, engine: AsyncRunner) -> Callable[..., Any]:
        @functools.wraps(self.fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            call, run = self.request(args, kwargs)
            if run is None:
                return await self.fn(*args, **kwargs)
            with self.calling(call):
                outcome = await engine.run(self.operation, **run)
            return self.returned(outcome)

        return call

    def request(self, args: Any, kwargs: Any) -> tuple[_Call, dict[str, Any] | None]:
        """The call, and what :meth:`Engine.run` is given for it: ``None`` for a call
        without a key where the key is optional, which runs unprotected (logged here)."""
        arguments = self.shape.bind(args, kwargs)
        qualname = self.shape.qualname
        call = _Call(self.operation, args, kwargs)
        key = self.key(arguments)
        if key is None and not self.key_required:
            logger.info(
                "%s",
                logfmt(event="unprotected", function=qualname),
                extra={"idempotency": "unprotected"},
            )
            return call, None
        scope = ""
        if self.scope is not None:
            scope = chosen_scope(
                as_key_text(self.scope(arguments), "scope", qualname),
                f"the scope rule of {qualname}",
            )
        run = {
            "key": as_key_text(key, "key", qualname),
            "scope": scope,
            "params": self.shape.params_of(arguments),
            "wait": self.wait,
        }
        return call, run

    @contextmanager
    def calling(self, call: _Call) -> Iterator[None]:
        reset = _CALL.set(call)
        try:
            yield
        except ParamsMismatch as exc:
            # The engine's text speaks of requests; this was a call with other arguments.
            raise ParamsMismatch(
                f"this idempotency key was already used to call {self.shape.qualname} with "
                "other arguments: to get that call's result, call it again with the same "
                "arguments; use a new key only for a different call",
                key=exc.key,
            ) from None
        except PydanticSerializationError as exc:
            if call.entered:
                raise  # the function's own
            # Validation accepted an argument that JSON cannot carry (an object where the
            # annotation says Any): refused before anything was stored, as bad input is.
            raise InvalidParams(
                f"the arguments of {self.shape.qualname} cannot be stored: {exc}"
            ) from exc
        finally:
            _CALL.reset(reset)

    def returned(self, outcome: Outcome) -> Any:
        if outcome.replayed and self.on_replay is not None:
            self.on_replay(outcome)
        if outcome.status != _RETURNED:
            body = outcome.body if isinstance(outcome.body, Mapping) else {}
            if _NOT_STORED in body:
                raise AbandonedCall(str(body[_NOT_STORED]))
            raise AbandonedCall(
                f"the call with this key was abandoned: {body.get('message', outcome.body)}"
            )
        form = JSON_TEXT if outcome.headers == _JSON_TEXT_HEADERS else VALUE
        return self.shape.load_return(form, outcome.body)

    @contextmanager
    def running(self, step: StepContext) -> Iterator[_Call]:
        call = _CALL.get()
        if call is None or call.operation is not self.operation:
            raise Retryable(
                f"a call of {self.shape.qualname} resumes only when it is called again "
                "with the same key"
            )
        call.entered = True
        reset = _STEP.set(step)
        try:
            yield call
        finally:
            _STEP.reset(reset)

    def step(self, step: StepContext, params: Any) -> dict[str, Any]:
        with self.running(step) as call:
            value = self.fn(*call.args, **call.kwargs)
        return self.stored(value)

    async def step_async(self, step: StepContext, params: Any) -> dict[str, Any]:
        with self.running(step) as call:
            value = await self.fn(*call.args, **call.kwargs)
        return self.stored(value)

    def reconciling(
        self, reconcile: Callable[..., Any], is_async: bool
    ) -> Callable[[StepContext, Any], Any]:
        """The step's ``reconcile=`` hook for the user's ``reconcile``, called as the
        function is (its arguments, :func:`downstream_key`): what it found is stored as the
        function's value would be, and :data:`NotFound` is passed on."""

        def found(value: object) -> object:
            return NotFound if value is NotFound else self.stored(value)

        def hook(step: StepContext, params: Any) -> object:
            with self.running(step) as call:
                return found(reconcile(*call.args, **call.kwargs))

        async def hook_async(step: StepContext, params: Any) -> object:
            with self.running(step) as call:
                return found(await reconcile(*call.args, **call.kwargs))

        return hook_async if is_async else hook

    def stored(self, value: object) -> dict[str, Any]:
        """What the step commits for ``value``: the function ran, so even a value that
        cannot be stored is recorded, as the refusal every later call gets."""
        try:
            return self.shape.stored_return(value)
        except ReturnNotStored as exc:
            logger.error("key of %s: %s", self.shape.qualname, exc)
            return {
                _NOT_STORED: f"{exc}. The call ran (its effects happened) and will not run "
                "again for this key: check them before calling with another key"
            }


def _finish(tx: Any, params: Any) -> Response:
    # Out of the state: the value is kept once, as the key's response.
    state = tx.state
    if JSON_TEXT in state:
        return Response(_RETURNED, state.pop(JSON_TEXT), _JSON_TEXT_HEADERS)
    if _NOT_STORED in state:
        return Response(500, {_NOT_STORED: state.pop(_NOT_STORED)})
    return Response(_RETURNED, state.pop(VALUE))


async def _finish_async(tx: Any, params: Any) -> Response:
    return _finish(tx, params)
