"""What every integration does around the engine, whatever the web framework.

A framework module reads the request (key header, method, target, body), asks the
application for the scope, calls one of :class:`BaseIdempotency`'s methods and sends the
:class:`~recoverypoint.integrations._problem.Reply` it gets back. Everything here is
framework-free, so FastAPI and Flask behave the same by construction.

Single-step endpoints
---------------------
An endpoint that needs no phases is run as an operation of two phases:

1. ``responded``, a foreign step, runs the endpoint (outside any transaction); its response
   (status, safe headers, body) is committed with the recovery point;
2. ``finished``, an atomic phase, answers that response. (An operation must end with an
   atomic phase; the engine commits it in one transaction with the step's result.)

So such an endpoint gets everything phased ones get: the atomic claim, the lease, the
fingerprint (method, path with query, body), the scope, and replays of its status, body and
safe headers. The first answer is the endpoint's own response, cookies included; replays
never carry ``Set-Cookie``. The response body is kept as the bytes the endpoint sent (as
text when it is UTF-8 without NUL, else in base64), so a replay carries the very same
bytes, and a ``Content-Digest``, ``ETag`` or signature header replayed with it still
matches them.

The request body is the operation's params: JSON, or else UTF-8 text. A body over the
engine's ``max_params_bytes`` is refused (413) before it is parsed; JSON nested too deep
is refused (422). Neither leaves a key behind.

An answer the framework gave before the endpoint's own code ran (FastAPI's 401 from an
auth dependency, its 422 for a body that fails validation) is not the key's answer: the
step raises :class:`~recoverypoint.operation.Withdrawn`, the key is forgotten, and the
client may send the request again, fixed, with the same key.

With an async engine (``rp.AsyncEngine``) an async endpoint's operation is async too: its
step awaits the endpoint on the event loop, in the request's own task.

The endpoint needs the live HTTP request, so only a request can run step 1: the completer,
which has none, gets :class:`~recoverypoint.Retryable` and backs off; the client's retry
with the same key runs the endpoint again. Work that must never run twice after a crash
belongs in phases.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

from ..engine import Engine
from ..engine.context import AtomicContext, StepContext
from ..errors import (
    ConfigurationError,
    IdempotencyError,
    InvalidParams,
    RequestTooLarge,
    Retryable,
)
from ..keys import MAX_JSON_DEPTH, safe_headers
from ..operation import FINISHED, Operation, Outcome, Response, Withdrawn
from ..operation import Request as KeyRequest
from ._problem import IDEMPOTENT_REPLAYED, Reply, outcome_reply, problem_reply, read_key

logger = logging.getLogger("recoverypoint.http")

RequestT = TypeVar("RequestT")

RESPONDED = "responded"

_FIELD_CONTROLS = str.maketrans("\x00\r\n", "   ")

# Headers the server frames the message with; it writes its own for the answer we send.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True)
class Captured:
    """A response as the endpoint produced it, every header included.

    ``endpoint_ran`` is false for an answer the framework gave before calling the endpoint
    (a dependency's 401, a validation 422): the request is then withdrawn, not stored.
    """

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    endpoint_ran: bool = True

    def reply(self) -> Reply:
        """The response as it is, for the request that produced it."""
        headers = [(k, v) for k, v in self.headers if k.lower() not in _FRAMING]
        return Reply(self.status, headers, self.body)

    def stored(self) -> dict[str, Any]:
        """What is committed for replays: safe headers only; the body's exact bytes."""
        joined: dict[str, str] = {}
        for name, raw in self.headers:
            # A NUL, CR or LF in a field value is replaced with a space, as RFC 9110 §5.5
            # allows (an endpoint may echo a client's header): jsonb cannot store a NUL.
            value = raw.translate(_FIELD_CONTROLS)
            joined[name] = f"{joined[name]}, {value}" if name in joined else value
        return {"status": self.status, "headers": safe_headers(joined), "body": _kept(self.body)}


# How a body is kept in jsonb: as text when it is UTF-8 without NUL (which jsonb refuses),
# else in base64; under a key of its own, so that a body stored as a JSON value (before
# bodies were kept as bytes) is told apart.
_TEXT = "$text"
_BASE64 = "$base64"


def _kept(body: bytes) -> dict[str, str]:
    try:
        text: str | None = body.decode()
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        return {_BASE64: base64.b64encode(body).decode("ascii")}
    return {_TEXT: text}


def _unkept(stored: Any) -> bytes | None:
    """The bytes :func:`_kept` stored, or ``None`` if ``stored`` is not such a body."""
    if isinstance(stored, dict) and len(stored) == 1:
        if isinstance(stored.get(_TEXT), str):
            return str(stored[_TEXT]).encode()
        if isinstance(stored.get(_BASE64), str):
            return base64.b64decode(stored[_BASE64])
    return None


def stored_reply(outcome: Outcome) -> Reply:
    """A single-step key's stored answer: the body's bytes as first sent, the stored headers;
    any other stored response (the completer's for an abandoned key) as
    :func:`~recoverypoint.integrations._problem.outcome_reply` makes it."""
    body = _unkept(outcome.body)
    if body is None:
        return outcome_reply(outcome)
    headers = list(outcome.headers.items())
    if outcome.replayed:
        headers.append((IDEMPOTENT_REPLAYED, "true"))
    return Reply(outcome.status, headers, body)


# The endpoint of the request being served, for the `responded` step; a context variable
# because the engine calls the step from inside `Engine.run`, in the same thread (or task).
_RESPONDER: ContextVar[Callable[[], Any] | None] = ContextVar(
    "recoverypoint_responder", default=None
)


def _responder() -> Callable[[], Any]:
    respond = _RESPONDER.get()
    if respond is None:
        raise Retryable(
            "a single-step request resumes only when its client retries with the same key"
        )
    return respond


def _responded(captured: Captured) -> dict[str, Any]:
    if not captured.endpoint_ran:
        raise Withdrawn(captured)  # nothing was done: forget the key, send this answer
    return {"response": captured.stored()}


def _respond(step: StepContext, params: Any) -> dict[str, Any]:
    return _responded(_responder()())


async def _respond_async(step: StepContext, params: Any) -> dict[str, Any]:
    return _responded(await _responder()())


def _finish(tx: AtomicContext, params: Any) -> Response:
    # Out of the state: the response is kept once, as the key's.
    stored = tx.state.pop("response")
    return Response(stored["status"], stored["body"], stored["headers"])


async def _finish_async(tx: Any, params: Any) -> Response:
    return _finish(tx, params)


class AsyncRunner(Protocol):
    """What the integrations need of ``rp.AsyncEngine``."""

    def register(self, *operations: Operation[Any]) -> None: ...

    async def run(
        self,
        operation: Operation[Any],
        *,
        key: str,
        params: Any,
        scope: str = ...,
        request: KeyRequest | None = ...,
    ) -> Outcome: ...


def is_async(operation: Operation[Any]) -> bool:
    """Whether ``operation``'s phases are coroutine functions (it runs on an async engine)."""
    return all(inspect.iscoroutinefunction(phase.fn) for phase in operation.phases)


def target(path: str, query: bytes) -> str:
    """The request target the fingerprint covers: the path and the query, if any.

    ``path`` is the decoded path the server hands the framework. Its ``%`` and ``?`` are
    encoded again, so that ``/a%3Fb`` (a path) and ``/a?b`` (a path and a query), or
    ``/a%3Fb`` and ``/a%253Fb``, fingerprint apart whatever the framework's own URL
    object does with them (Starlette 1.7, the last for Python 3.10, escapes neither).
    """
    path = path.replace("%", "%25").replace("?", "%3F")
    return f"{path}?{query.decode('latin-1')}" if query else path


class BaseIdempotency(Generic[RequestT]):
    """Serves idempotent requests through an :class:`~recoverypoint.Engine`.

    Parameters
    ----------
    engine:
        The engine that runs the operations; single-step operations are registered with it.
    scope:
        Called with each request; returns who owns its key (the authenticated user's or
        tenant's id). Keys never collide across scopes. Raise the framework's own HTTP
        error (401...) to refuse the request before any key is looked at.
    retry_after:
        Seconds sent in ``Retry-After`` with 409 and 503 answers.
    async_engine:
        An ``rp.AsyncEngine`` on the same database, for frameworks with async endpoints:
        operations of async phases and async single-step endpoints run on it, on the event
        loop; everything else runs on ``engine`` as before.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        scope: Callable[[RequestT], str],
        retry_after: int = 1,
        async_engine: AsyncRunner | None = None,
    ) -> None:
        if retry_after < 1:
            raise ValueError("retry_after must be at least 1 second")
        self.engine = engine
        self.async_engine = async_engine
        self.scope = scope
        self.retry_after = retry_after

    def _scope_of(
        self, request: RequestT, when: str, refusals: tuple[type[Exception], ...]
    ) -> str | Reply:
        """The scope of ``request``, or the answer when the scope function fails: the
        framework's own refusals (a 401) propagate, as the application meant them; any
        other failure is the service's (a :class:`~recoverypoint.ConfigurationError`,
        logged naming the function and ``when`` it runs), which no retry mends."""
        try:
            return self.scope(request)
        except refusals:
            raise
        except Exception as exc:
            name = getattr(self.scope, "__qualname__", None) or repr(self.scope)
            error = ConfigurationError(
                f"the scope function {name} failed ({type(exc).__name__}: {exc}); it runs "
                f"{when}"
            )
            logger.error("%s", error, exc_info=exc)
            return problem_reply(error, retry_after=self.retry_after)

    def _declare_single_step(
        self, name: str, lock_timeout: timedelta, *, on_loop: bool = False
    ) -> Operation[Any]:
        """The operation of a single-step endpoint; ``on_loop`` for an async endpoint run
        by the async engine."""
        operation: Operation[Any] = Operation(name, lock_timeout=lock_timeout)
        if on_loop:
            assert self.async_engine is not None
            operation.foreign_step(RESPONDED)(_respond_async)
            operation.atomic_phase(FINISHED)(_finish_async)
            self.async_engine.register(operation)
        else:
            operation.foreign_step(RESPONDED)(_respond)
            operation.atomic_phase(FINISHED)(_finish)
            self.engine.register(operation)
        return operation

    def _serve(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Reply:
        """Serve a phased request; ``params`` is called once the key header was read, and
        may refuse the request with an :class:`~recoverypoint.IdempotencyError`."""
        result = self._execute(operation, scope, key_headers, method, target, params)
        return outcome_reply(result) if isinstance(result, Outcome) else result

    async def _serve_async(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Reply:
        """:meth:`_serve` on the async engine, for an operation of async phases."""
        result = await self._execute_async(operation, scope, key_headers, method, target, params)
        return outcome_reply(result) if isinstance(result, Outcome) else result

    def _serve_single_step(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        body: Callable[[], bytes],
        respond: Callable[[], Captured],
    ) -> tuple[Reply, bool]:
        """Serve a single-step request; ``respond`` runs the endpoint, if the key needs it.

        Returns the answer, and whether it is the endpoint's answer of this very request,
        now committed as the key's: only then may work that follows the answer run (FastAPI's
        background tasks).
        """
        produced: list[Captured] = []

        def respond_and_keep() -> Captured:
            produced.append(respond())
            return produced[-1]

        reset = _RESPONDER.set(respond_and_keep)
        try:
            result = self._execute(
                operation, scope, key_headers, method, target, self._single_step_params(body)
            )
        finally:
            _RESPONDER.reset(reset)
        return _single_step_reply(result, produced)

    async def _serve_single_step_async(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        body: Callable[[], bytes],
        respond: Callable[[], Awaitable[Captured]],
    ) -> tuple[Reply, bool]:
        """:meth:`_serve_single_step` on the async engine, for an async endpoint."""
        produced: list[Captured] = []

        async def respond_and_keep() -> Captured:
            produced.append(await respond())
            return produced[-1]

        reset = _RESPONDER.set(respond_and_keep)
        try:
            result = await self._execute_async(
                operation, scope, key_headers, method, target, self._single_step_params(body)
            )
        finally:
            _RESPONDER.reset(reset)
        return _single_step_reply(result, produced)

    def _single_step_params(self, body: Callable[[], bytes]) -> Callable[[], Any]:
        # The body is read inside the engine call, so that a refusal while reading it (too
        # large) is answered as every other refusal is.
        return lambda: single_step_params(body(), self.engine.max_params_bytes)

    def _execute(
        self,
        operation: Operation[Any],
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Outcome | Reply:
        try:
            key = read_key(key_headers)
            return self.engine.run(
                operation,
                key=key,
                scope=scope,
                params=params(),
                request=KeyRequest(method, target),
            )
        except Exception as exc:
            return self._refusal(exc, method, target)

    async def _execute_async(
        self,
        operation: Operation[Any],
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Outcome | Reply:
        """:meth:`_execute` on the async engine, for an operation of async phases."""
        assert self.async_engine is not None
        try:
            key = read_key(key_headers)
            return await self.async_engine.run(
                operation,
                key=key,
                scope=scope,
                params=params(),
                request=KeyRequest(method, target),
            )
        except Exception as exc:
            return self._refusal(exc, method, target)

    def _refusal(self, exc: Exception, method: str, target: str) -> Reply:
        if isinstance(exc, Withdrawn) and isinstance(exc.answer, Captured):
            return exc.answer.reply()  # the framework's own refusal, as it is, unstored
        if not isinstance(exc, IdempotencyError) or exc.http_status == 500:
            # The client gets a problem+json without detail; the operator gets it all.
            logger.error("%s %s failed; answered 500", method, target, exc_info=exc)
        return problem_reply(exc, retry_after=self.retry_after)


def _single_step_reply(result: Outcome | Reply, produced: list[Captured]) -> tuple[Reply, bool]:
    if not isinstance(result, Outcome):
        return result, False
    if produced and not result.replayed:
        return produced[-1].reply(), True  # this request ran the endpoint, finished the key
    return stored_reply(result), False


def body_params(body: bytes, limit: int) -> Any:
    """A request's params read from its body: JSON, or else UTF-8 text. Too large (413),
    nested too deep, with a name twice in one object, or neither JSON nor UTF-8 (422):
    refused, never a 500."""
    return _read_body(body, limit)[1]


def single_step_params(body: bytes, limit: int) -> Any:
    """A single-step request's params: its body as :func:`body_params` reads it, marked JSON
    or text, so that the text ``abc`` and the JSON ``"abc"`` are two requests."""
    kind, value = _read_body(body, limit)
    return None if kind is None else {kind: value}


def body_over(limit: int) -> RequestTooLarge:
    """The refusal of a body found past ``limit`` bytes, before it was read whole."""
    return RequestTooLarge(f"the request body takes more than {limit} bytes, the limit")


def _read_body(body: bytes, limit: int) -> tuple[str | None, Any]:
    if len(body) > limit:  # refused before it costs a parse
        raise RequestTooLarge(f"the request body takes {len(body)} bytes; the limit is {limit}")
    if not body:
        return None, None
    try:
        # UTF-8 only (a BOM is dropped): json.loads would also guess UTF-16 and UTF-32.
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidParams("the request body must be JSON or UTF-8 text") from None
    try:
        return "json", json.loads(text, object_pairs_hook=_unique_names)
    except RecursionError:
        raise InvalidParams(
            f"the request body is JSON nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    except _DuplicateName as exc:
        raise InvalidParams(
            f"the request body names {exc.args[0]!r:.40} twice in one object; send each name once"
        ) from None
    except ValueError:
        return "text", text


class _DuplicateName(Exception):
    pass


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object without a name twice: ``{"a": 0, "a": 1}`` is ambiguous (RFC 8259 §4)."""
    result = dict(pairs)
    if len(result) < len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateName(name)
            seen.add(name)
    return result
