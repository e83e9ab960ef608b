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
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

from ..engine import Engine
from ..engine.context import AtomicContext, StepContext
from ..engine.waits import wait_seconds
from ..errors import (
    ConfigurationError,
    IdempotencyError,
    InvalidParams,
    RequestTooLarge,
    Retryable,
)
from ..keys import MAX_JSON_DEPTH, UNSCOPED, Unscoped, chosen_scope, safe_headers
from ..logfmt import logfmt
from ..operation import FINISHED, AsyncRunner, Operation, Outcome, Response, Withdrawn
from ..operation import Request as KeyRequest
from ._openapi import Declaration, declared
from ._problem import (
    IDEMPOTENCY_KEY,
    IDEMPOTENT_REPLAYED,
    IDEMPOTENT_UNPROTECTED,
    Reply,
    header_name,
    outcome_reply,
    problem_reply,
    read_key,
)

logger = logging.getLogger("recoverypoint.http")

RequestT = TypeVar("RequestT")
E = TypeVar("E", bound=Callable[..., Any])

RESPONDED = "responded"

_FIELD_CONTROLS = str.maketrans("\x00\r\n", "   ")

# Headers the server frames the message with; it writes its own for the answer we send.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True)
class Captured:
    """A response as the endpoint produced it, every header included.

    ``endpoint_ran`` is false for an answer the framework gave before calling the endpoint
    (a dependency's 401, a validation 422); ``kept`` is false for an answer of a status
    class the integration does not store. Either way the request is withdrawn, not stored.
    """

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    endpoint_ran: bool = True
    kept: bool = True

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


def stored_reply(outcome: Outcome, replayed_header: str = IDEMPOTENT_REPLAYED) -> Reply:
    """A single-step key's stored answer: the body's bytes as first sent, the stored headers;
    any other stored response (the completer's for an abandoned key) as
    :func:`~recoverypoint.integrations._problem.outcome_reply` makes it."""
    body = _unkept(outcome.body)
    if body is None:
        return outcome_reply(outcome, replayed_header)
    headers = list(outcome.headers.items())
    if outcome.replayed:
        headers.append((replayed_header, "true"))
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
    if not (captured.endpoint_ran and captured.kept):
        raise Withdrawn(captured)  # forget the key, send this answer
    return {"response": captured.stored()}


def _respond(step: StepContext, params: Any) -> dict[str, Any]:
    return _responded(_responder()())


async def _respond_async(step: StepContext, params: Any) -> dict[str, Any]:
    return _responded(await _responder()())


def is_single_step(operation: Operation[Any]) -> bool:
    """Whether ``operation`` is a single-step endpoint's: its view runs only inside a
    request, so only its client's retry resumes it."""
    return bool(operation.phases) and operation.phases[0].fn in (_respond, _respond_async)


def _finish(tx: AtomicContext, params: Any) -> Response:
    # Out of the state: the response is kept once, as the key's.
    stored = tx.state.pop("response")
    return Response(stored["status"], stored["body"], stored["headers"])


async def _finish_async(tx: Any, params: Any) -> Response:
    return _finish(tx, params)


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


UNPROTECTED = (IDEMPOTENT_UNPROTECTED, "true")
"""The header of an answer to a request that sent no key where the key is optional."""


def log_unprotected(method: str, target: str, status: int) -> None:
    """Say that a request ran without a key (where its route made the key optional): a
    line, and the record's ``idempotency`` field, for a log pipeline to count them."""
    logger.info(
        "%s",
        logfmt(event="unprotected", method=method, target=target, status=status),
        extra={"idempotency": "unprotected"},
    )


STORED_CLASSES = (2, 3, 4, 5)
"""The status classes of the single-step answers stored by default: all of them (see
:class:`BaseIdempotency`'s ``stored_classes``)."""


class BaseIdempotency(Generic[RequestT]):
    """Serves idempotent requests through an :class:`~recoverypoint.Engine`.

    Parameters
    ----------
    engine:
        The engine that runs the operations; single-step operations are registered with it.
    scope:
        Called with each request; returns who owns its key (the authenticated user's or
        tenant's id). Keys never collide across scopes. Raise the framework's own HTTP
        error (401...) to refuse the request before any key is looked at. A scope function
        that returns ``""`` is the service's mistake (a 500 that says so): pass
        :data:`~recoverypoint.integrations.UNSCOPED` instead to put every key in one
        scope shared by all clients, on purpose.
    retry_after:
        Seconds sent in ``Retry-After`` with 409 and 503 answers.
    async_engine:
        An ``rp.AsyncEngine`` on the same database, for frameworks with async endpoints:
        operations of async phases and async single-step endpoints run on it, on the event
        loop; everything else runs on ``engine`` as before.
    key_header:
        The name of the header the key is read from, for clients that use another.
    replayed_header:
        The name of the header that marks a replay, for clients that expect another.
    wait:
        How long a request that finds its key in use waits for the request that holds it
        (at most a minute, see :mod:`recoverypoint.engine.waits`), to answer with that
        request's answer (a replay), instead of 409 at once. A sync server's worker waits
        with it; 409 when the wait runs out.
    stored_classes:
        The status classes (2 for 2xx...) of the single-step answers stored as the key's and
        replayed; by default all. An answer of another class is sent as it is and the key
        forgotten, so that a retry with the key runs the endpoint again. (A phased
        operation decides in its phases: a returned ``Response`` is stored, an
        ``rp.Retryable`` is not.)
    """

    def __init__(
        self,
        engine: Engine,
        *,
        scope: Callable[[RequestT], str] | Unscoped,
        retry_after: int = 1,
        async_engine: AsyncRunner | None = None,
        key_header: str = IDEMPOTENCY_KEY,
        replayed_header: str = IDEMPOTENT_REPLAYED,
        stored_classes: Collection[int] = STORED_CLASSES,
        wait: timedelta | float | None = None,
    ) -> None:
        if retry_after < 1:
            raise ValueError("retry_after must be at least 1 second")
        wait_seconds(wait)  # refused now rather than at every request
        if scope is not UNSCOPED and not callable(scope):
            raise ValueError(
                "scope must be a function of the request that returns who owns its key "
                "(the user's or tenant's id), or UNSCOPED to share one scope among all "
                f"clients on purpose; got {scope!r:.80}"
            )
        self.engine = engine
        self.async_engine = async_engine
        self.scope = scope
        self.retry_after = retry_after
        self.key_header = header_name(key_header, "key_header")
        self.replayed_header = header_name(replayed_header, "replayed_header")
        if self.key_header.lower() == self.replayed_header.lower():
            raise ValueError(f"key_header and replayed_header are both {key_header!r}")
        self.stored_classes = _status_classes(stored_classes)
        self.wait = wait

    def phased(self, *, key_required: bool = True) -> Callable[[E], E]:
        """Declare an endpoint that calls ``run`` in the application's schema (FastAPI's
        OpenAPI, DRF's with drf-spectacular), as a single-step endpoint declares itself:
        the key header, the replay header, the problem answers. Say the same
        ``key_required`` as the endpoint's ``run``. It changes nothing else."""

        def declare(endpoint: E) -> E:
            return declared(endpoint, self._declaration(key_required))

        return declare

    def _declaration(self, key_required: bool) -> Declaration:
        return Declaration(self.key_header, self.replayed_header, key_required)

    def _scope_of(
        self, request: RequestT, when: str, refusals: tuple[type[Exception], ...]
    ) -> str | Reply:
        """The scope of ``request``, or the answer when the scope function fails: the
        framework's own refusals (a 401) propagate, as the application meant them; any
        other failure, an empty scope included, is the service's (a
        :class:`~recoverypoint.ConfigurationError`, logged naming the function and ``when``
        it runs), which no retry mends."""
        if self.scope is UNSCOPED:
            return ""
        name = getattr(self.scope, "__qualname__", None) or repr(self.scope)
        try:
            return chosen_scope(self.scope(request), f"the scope function {name}")
        except refusals:
            raise
        except Exception as exc:
            error = ConfigurationError(
                f"the scope function {name} failed ({type(exc).__name__}: {exc}); it runs {when}"
            )
            logger.error("%s", error, exc_info=exc)
            return problem_reply(error, retry_after=self.retry_after)

    def _key_headers(self, lines: Sequence[str], key_required: bool) -> Sequence[str] | None:
        """The lines of the key header, or ``None`` when the route's key is optional and
        the request sent none: it then runs unprotected (:meth:`_unprotected`). A header
        sent empty is still a mistake (400), not a choice."""
        return None if not lines and not key_required else lines

    def _unprotected(self, reply: Reply, method: str, target: str) -> Reply:
        """``reply``, for a request that ran without a key, marked as unprotected; logged."""
        log_unprotected(method, target, reply.status)
        return replace(reply, headers=[*reply.headers, UNPROTECTED])

    def _declare_single_step(
        self,
        name: str,
        lock_timeout: timedelta,
        dedupe_window: timedelta | None,
        *,
        on_loop: bool = False,
    ) -> Operation[Any]:
        """The operation of a single-step endpoint; ``on_loop`` for an async endpoint run
        by the async engine."""
        operation: Operation[Any] = Operation(name, lock_timeout=lock_timeout)
        step = operation.foreign_step(RESPONDED, dedupe_window=dedupe_window)
        if on_loop:
            assert self.async_engine is not None
            step(_respond_async)
            operation.atomic_phase(FINISHED)(_finish_async)
            self.async_engine.register(operation)
        else:
            step(_respond)
            operation.atomic_phase(FINISHED)(_finish)
            self.engine.register(operation)
        return operation

    def _serve(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Reply:
        """Serve a phased request; ``params`` is called once the key header was read, and
        may refuse the request with an :class:`~recoverypoint.IdempotencyError`. Without
        key headers (``None``: an optional key not sent) it runs under a key of its own,
        which no retry can name: its phases and their recovery as ever, no protection from
        a duplicate."""
        result = self._execute(operation, scope, key_headers, method, target, params)
        return self._phased_reply(result, key_headers, method, target)

    async def _serve_async(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Reply:
        """:meth:`_serve` on the async engine, for an operation of async phases."""
        result = await self._execute_async(operation, scope, key_headers, method, target, params)
        return self._phased_reply(result, key_headers, method, target)

    def _phased_reply(
        self,
        result: Outcome | Reply,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
    ) -> Reply:
        reply = (
            outcome_reply(result, self.replayed_header) if isinstance(result, Outcome) else result
        )
        return reply if key_headers is not None else self._unprotected(reply, method, target)

    def _serve_single_step(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
        body: Callable[[], bytes],
        respond: Callable[[], Captured],
    ) -> tuple[Reply, bool]:
        """Serve a single-step request; ``respond`` runs the endpoint, if the key needs it.
        Without key headers (``None``: an optional key not sent) the endpoint runs as it
        is, nothing stored, its answer marked unprotected.

        Returns the answer, and whether it is the endpoint's answer of this very request,
        now committed as the key's: only then may work that follows the answer run (FastAPI's
        background tasks).
        """
        if key_headers is None:
            return self._unprotected(respond().reply(), method, target), True
        produced: list[Captured] = []

        def respond_and_keep() -> Captured:
            produced.append(self._judged(respond()))
            return produced[-1]

        reset = _RESPONDER.set(respond_and_keep)
        try:
            result = self._execute(
                operation, scope, key_headers, method, target, self._single_step_params(body)
            )
        finally:
            _RESPONDER.reset(reset)
        return self._single_step_reply(result, produced)

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
            produced.append(self._judged(await respond()))
            return produced[-1]

        reset = _RESPONDER.set(respond_and_keep)
        try:
            result = await self._execute_async(
                operation, scope, key_headers, method, target, self._single_step_params(body)
            )
        finally:
            _RESPONDER.reset(reset)
        return self._single_step_reply(result, produced)

    def _judged(self, captured: Captured) -> Captured:
        """``captured``, not to be kept when its status class is not stored."""
        if captured.status // 100 in self.stored_classes:
            return captured
        logger.info(
            "%s",
            logfmt(event="answer_not_stored", status=captured.status),
            extra={"idempotency": "not_stored"},
        )
        return replace(captured, kept=False)

    def _single_step_params(self, body: Callable[[], bytes]) -> Callable[[], Any]:
        # The body is read inside the engine call, so that a refusal while reading it (too
        # large) is answered as every other refusal is.
        return lambda: single_step_params(body(), self.engine.max_params_bytes)

    def _key(self, key_headers: Sequence[str] | None) -> str:
        if key_headers is None:
            return f"unprotected-{uuid.uuid4()}"  # a key no other request can send
        return read_key(key_headers, self.key_header)

    def _execute(
        self,
        operation: Operation[Any],
        scope: str,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Outcome | Reply:
        try:
            key = self._key(key_headers)
            return self.engine.run(
                operation,
                key=key,
                scope=scope,
                params=params(),
                request=KeyRequest(method, target),
                wait=self.wait,
            )
        except Exception as exc:
            return self._refusal(exc, method, target)

    async def _execute_async(
        self,
        operation: Operation[Any],
        scope: str,
        key_headers: Sequence[str] | None,
        method: str,
        target: str,
        params: Callable[[], Any],
    ) -> Outcome | Reply:
        """:meth:`_execute` on the async engine, for an operation of async phases."""
        assert self.async_engine is not None
        try:
            key = self._key(key_headers)
            return await self.async_engine.run(
                operation,
                key=key,
                scope=scope,
                params=params(),
                request=KeyRequest(method, target),
                wait=self.wait,
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

    def _single_step_reply(
        self, result: Outcome | Reply, produced: list[Captured]
    ) -> tuple[Reply, bool]:
        if not isinstance(result, Outcome):
            return result, False
        if produced and not result.replayed:
            return produced[-1].reply(), True  # this request ran the endpoint, finished the key
        return stored_reply(result, self.replayed_header), False


def _status_classes(classes: object) -> frozenset[int]:
    """``classes`` as a set of status classes: some of 2, 3, 4 and 5, at least one."""
    unfit = isinstance(classes, str | bytes) or not isinstance(classes, Collection)
    items: list[Any] = [] if unfit else list(cast(Collection[Any], classes))
    if not items or not all(type(c) is int and c in STORED_CLASSES for c in items):
        raise ValueError(
            "stored_classes must name some of the status classes 2, 3, 4 and 5 (2 for "
            f"2xx...), at least one; got {classes!r:.80}"
        )
    return frozenset(items)


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
