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
never carry ``Set-Cookie``. Responses are stored as JSON values (JSON bodies) or text (any
other body, decoded as UTF-8): single-step endpoints are meant for JSON APIs.

The endpoint needs the live HTTP request, so only a request can run step 1: the completer,
which has none, gets :class:`~recoverypoint.Retryable` and backs off; the client's retry
with the same key runs the endpoint again. Work that must never run twice after a crash
belongs in phases.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from ..context import AtomicContext, StepContext
from ..engine import Engine
from ..errors import IdempotencyError, InvalidParams, Retryable
from ..keys import safe_headers
from ..operation import FINISHED, Operation, Outcome, Response
from ..operation import Request as KeyRequest
from ._problem import Reply, outcome_reply, problem_reply, read_key

logger = logging.getLogger("recoverypoint.http")

RequestT = TypeVar("RequestT")

RESPONDED = "responded"

# Headers the server frames the message with; it writes its own for the answer we send.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True)
class Captured:
    """A response as the endpoint produced it, every header included."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def reply(self) -> Reply:
        """The response as it is, for the request that produced it."""
        headers = [(k, v) for k, v in self.headers if k.lower() not in _FRAMING]
        return Reply(self.status, headers, self.body)

    def stored(self) -> dict[str, Any]:
        """What is committed for replays: safe headers only; a JSON body as its value."""
        joined: dict[str, str] = {}
        for name, value in self.headers:
            joined[name] = f"{joined[name]}, {value}" if name in joined else value
        headers = safe_headers(joined)
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        body: Any = self.body.decode("utf-8", "replace")
        if "json" in content_type.lower():
            # Invalid JSON is kept as text: the endpoint already ran, its answer must be kept.
            with contextlib.suppress(ValueError):
                body = json.loads(body)
        return {"status": self.status, "headers": headers, "body": body}


# The endpoint of the request being served, for the `responded` step; a context variable
# because the engine calls the step from inside `Engine.run`, in the same thread.
_RESPONDER: ContextVar[Callable[[], Captured] | None] = ContextVar(
    "recoverypoint_responder", default=None
)


def _respond(step: StepContext, params: Any) -> dict[str, Any]:
    respond = _RESPONDER.get()
    if respond is None:
        raise Retryable(
            "a single-step request resumes only when its client retries with the same key"
        )
    return {"response": respond().stored()}


def _finish(tx: AtomicContext, params: Any) -> Response:
    stored = tx.state["response"]
    return Response(stored["status"], stored["body"], stored["headers"])


def target(path: str, query: str) -> str:
    """The request target the fingerprint covers: the path and the query, if any."""
    return f"{path}?{query}" if query else path


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
    """

    def __init__(
        self, engine: Engine, *, scope: Callable[[RequestT], str], retry_after: int = 1
    ) -> None:
        if retry_after < 1:
            raise ValueError("retry_after must be at least 1 second")
        self.engine = engine
        self.scope = scope
        self.retry_after = retry_after

    def _declare_single_step(self, name: str, lock_timeout: timedelta) -> Operation[Any]:
        operation: Operation[Any] = Operation(name, lock_timeout=lock_timeout)
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
        params: Any,
    ) -> Reply:
        result = self._execute(operation, scope, key_headers, method, target, lambda: params)
        return outcome_reply(result) if isinstance(result, Outcome) else result

    def _serve_single_step(
        self,
        operation: Operation[Any],
        *,
        scope: str,
        key_headers: Sequence[str],
        method: str,
        target: str,
        body: bytes,
        respond: Callable[[], Captured],
    ) -> Reply:
        produced: list[Captured] = []

        def respond_and_keep() -> Captured:
            produced.append(respond())
            return produced[-1]

        reset = _RESPONDER.set(respond_and_keep)
        try:
            result = self._execute(
                operation, scope, key_headers, method, target, lambda: _body_params(body)
            )
        finally:
            _RESPONDER.reset(reset)
        if not isinstance(result, Outcome):
            return result
        if produced and not result.replayed:
            return produced[-1].reply()  # this request ran the endpoint and finished the key
        return outcome_reply(result)

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
            if not isinstance(exc, IdempotencyError) or exc.http_status == 500:
                # The client gets a problem+json without detail; the operator gets it all.
                logger.error("%s %s failed; answered 500", method, target, exc_info=exc)
            return problem_reply(exc, retry_after=self.retry_after)


def _body_params(body: bytes) -> Any:
    """A single-step request's params: its JSON body, or its text; it is fingerprinted."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        pass
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise InvalidParams("the request body must be JSON or UTF-8 text") from None
