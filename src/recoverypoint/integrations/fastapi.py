"""FastAPI and Starlette: idempotent endpoints that answer as the IETF draft says.

Starlette is what it serves, so any Starlette application, FastAPI's included; with FastAPI
installed, every FastAPI application's OpenAPI schema declares its idempotent routes (the
key, the replay header, the problem answers), with nothing written (see
``declare_openapi`` for an application with an ``openapi`` function of its own). Install
with ``pip install 'recoverypoint[fastapi]'``.

A phased operation, from a sync or an async route::

    idempotency = Idempotency(engine, scope=lambda request: request.user.identity)

    @app.post("/rides")
    @idempotency.phased()  # declared in the schema
    def post_ride(request: Request, body: RideParams) -> Response:
        return idempotency.run(rides, request, body)

    @app.post("/rides/async")
    @idempotency.phased()
    async def post_ride_async(request: Request, body: RideParams) -> Response:
        return await idempotency.run_async(rides, request, body)

A single-step endpoint (see ``recoverypoint.integrations._base``)::

    app.add_middleware(SingleStepMiddleware)

    @app.post("/orders", status_code=201)
    @idempotency.single_step("create_order")
    def create_order(order: Order) -> dict[str, Any]: ...

Give it an ``rp.AsyncEngine`` as well, ``Idempotency(engine, async_engine=async_engine,
scope=...)``, and operations of ``async def`` phases (``run_async``) and ``async def``
single-step endpoints run on the event loop, in the request's task, with no thread hop:
a slow foreign call then holds no thread, so a thousand of them wait at once. Everything
else runs on the sync engine in a worker thread, as without it, so the event loop never
waits on PostgreSQL either way.

For a single-step endpoint, what FastAPI does after sending the response (the route's
background tasks, the exit of request-scoped dependencies with ``yield``) waits until the
answer is committed and sent, and never runs for an answer that was not committed (an
error, a lease lost). A background task that fails then changes neither the answer nor the
key; it is logged. An answer FastAPI gave before calling the endpoint (a dependency's 401,
a 422 for a body that fails validation) leaves no key behind: the client may fix its
request and send it again with the same key.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InvalidKey, RequestTooLarge
from ..leases import DEFAULT_LOCK_TIMEOUT
from ..operation import Operation
from ._base import (
    UNPROTECTED,
    BaseIdempotency,
    Captured,
    body_over,
    is_async,
    log_unprotected,
    logger,
    target,
)
from ._openapi import PROBLEM_COMPONENT, PROBLEM_SCHEMA, declaration_of, declare, declared
from ._problem import Reply, http_problem, problem, problem_reply, read_key

__all__ = ["Idempotency", "SingleStepMiddleware", "declare_openapi"]

E = TypeVar("E", bound=Callable[..., Any])


class Idempotency(BaseIdempotency[Request]):
    """Runs operations for Starlette requests and answers with Starlette responses.

    ``scope`` is called with the :class:`~starlette.requests.Request`. For a single-step
    endpoint it runs in the middleware, before the route's dependencies: derive the scope
    from headers or from what an outer middleware set (``request.user``...). A scope
    function that raises (but for an ``HTTPException``, its refusal) is the service's
    mistake: a 500 ``problem+json`` that says so, logged naming the function.
    """

    def run(
        self,
        operation: Operation[Any],
        request: Request,
        params: Any,
        *,
        key_required: bool = True,
    ) -> Response:
        """Run ``operation`` for ``request`` with ``params``; for sync routes.

        Errors become ``application/problem+json`` answers; a replay carries
        ``Idempotent-Replayed: true``. With ``key_required=False`` a request that sends no
        key runs unprotected (under a key of its own, which no retry can name), its answer
        marked ``Idempotent-Unprotected: true``.
        """
        _warn_undeclared(request.scope.get("app"), request.scope.get("route"), phased=True)
        scope = self._scope_of(request, _IN_ROUTE, (HTTPException,))
        if isinstance(scope, Reply):
            return _response(scope)
        reply = self._serve(
            operation,
            scope=scope,
            key_headers=self._key_headers(request.headers.getlist(self.key_header), key_required),
            method=request.method,
            target=_target(request),
            params=lambda: params,
        )
        return _response(reply)

    async def run_async(
        self,
        operation: Operation[Any],
        request: Request,
        params: Any,
        *,
        key_required: bool = True,
    ) -> Response:
        """Async version of :meth:`run`: an operation of async phases runs on the async
        engine, on the event loop; any other on the sync engine, in a worker thread."""
        if self.async_engine is None or not is_async(operation):
            run = functools.partial(self.run, key_required=key_required)
            return await run_in_threadpool(run, operation, request, params)
        _warn_undeclared(request.scope.get("app"), request.scope.get("route"), phased=True)
        scope = self._scope_of(request, _IN_ROUTE, (HTTPException,))
        if isinstance(scope, Reply):
            return _response(scope)
        reply = await self._serve_async(
            operation,
            scope=scope,
            key_headers=self._key_headers(request.headers.getlist(self.key_header), key_required),
            method=request.method,
            target=_target(request),
            params=lambda: params,
        )
        return _response(reply)

    def single_step(
        self,
        name: str,
        *,
        lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
        key_required: bool = True,
        dedupe_window: timedelta | None = None,
    ) -> Callable[[E], E]:
        """Make an endpoint single-step: its whole response is stored under the key and
        replayed. ``name`` is the operation's stable name; renaming the function keeps it.

        Put it below the route decorator. It needs :class:`SingleStepMiddleware`; without
        it the endpoint refuses to run (500) rather than run unprotected. An ``async def``
        endpoint runs on the event loop when there is an async engine. With
        ``key_required=False`` a request that sends no key runs the endpoint unprotected
        (nothing stored), its answer marked ``Idempotent-Unprotected: true``.

        ``dedupe_window``: how long the services the endpoint calls remember an idempotency
        key (Stripe: 24 hours). Once that long has passed since a request's first run began,
        a retry of the unfinished key never runs the endpoint blindly again: it answers 423
        (needs reconciliation) and the key waits for ``recoverypoint keys reconcile``.
        """

        def decorate(endpoint: E) -> E:
            on_loop = self.async_engine is not None and inspect.iscoroutinefunction(endpoint)
            operation = self._declare_single_step(
                name, lock_timeout, dedupe_window, on_loop=on_loop
            )
            guarded = declared(_guarded(endpoint), self._declaration(key_required))
            # Both: should this decorator be put above the route's, the route has the
            # endpoint itself, which the middleware must recognise all the same.
            _SINGLE_STEPS[guarded] = _SINGLE_STEPS[endpoint] = (self, operation, key_required)
            return guarded

        return decorate


def declare_openapi(app: Any) -> None:
    """Declare the idempotent routes in ``app.openapi()`` when the application replaced it
    with an ``openapi`` function of its own (FastAPI's way to extend a schema): call it once,
    after that assignment. Any other FastAPI application declares them with nothing written.

    What is declared, in ``/openapi.json``, ``/docs`` and the clients generated from them:
    what each route served through an :class:`Idempotency` sends and answers, the key header
    (required or not, its format), ``Idempotent-Replayed`` and the
    ``application/problem+json`` answers (400, 409, 413, 422, 423, 503). Single-step
    endpoints declare themselves; a route that calls ``run`` says so with
    ``@idempotency.phased()``. The key is declared in the schema only; the integration still
    reads and checks it, so a bad key is its 400, never FastAPI's 422.
    """
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        return _declared_in(app, generate())

    setattr(openapi, _DECLARES, True)
    app.openapi = openapi


def _declare_every_fastapi_schema() -> None:
    """Wrap ``FastAPI.openapi``, which ``/openapi.json`` and ``/docs`` call, so that every
    FastAPI application's schema declares its idempotent routes with nothing written by its
    authors: FastAPI learns of a route only from its decorator's arguments and its
    endpoint's signature, which a route that calls ``run`` inside its body leaves silent,
    and it offers a library no hook into an application's schema but this method."""
    try:
        from fastapi import FastAPI
    except ImportError:  # Starlette alone, which has no schema
        return
    generate = FastAPI.openapi
    if getattr(generate, _DECLARES, False):
        return  # this module imported twice (importlib.reload)

    @functools.wraps(generate)
    def openapi(self: Any) -> dict[str, Any]:
        return _declared_in(self, generate(self))

    setattr(openapi, _DECLARES, True)
    setattr(FastAPI, "openapi", openapi)  # noqa: B010 (mypy refuses assigning a method)


# Marks a function that declares the idempotent routes in what it returns.
_DECLARES = "__recoverypoint_declares__"
# Where an application keeps the schema its routes were last declared in.
_DECLARED_IN = "_recoverypoint_declared_in"
_DECLARING = threading.Lock()


def _declared_in(app: Any, schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``app``'s idempotent routes declared, once per schema object: FastAPI
    caches it, and declaring twice (two threads asking at once) would repeat the answers'
    descriptions."""
    with _DECLARING:
        if vars(app).get(_DECLARED_IN) is not schema:
            _declare_routes(schema, app.routes)
            vars(app)[_DECLARED_IN] = schema
    return schema


def _declare_routes(schema: dict[str, Any], routes: Iterable[BaseRoute]) -> None:
    paths: dict[str, Any] = schema.get("paths", {})
    for route in routes:
        declaration = declaration_of(getattr(route, "endpoint", None))
        path = paths.get(getattr(route, "path_format", ""))
        if declaration is None or path is None:
            continue  # not ours, or not in the schema (include_in_schema=False)
        for method in getattr(route, "methods", None) or ():
            operation = path.get(method.lower())
            if operation is not None:
                declare(operation, declaration, f"#/components/schemas/{PROBLEM_COMPONENT}")
                components = schema.setdefault("components", {}).setdefault("schemas", {})
                components[PROBLEM_COMPONENT] = copy.deepcopy(PROBLEM_SCHEMA)


# Applications and endpoints already warned of (by sync endpoints' threads too: hence the
# lock).
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
_WARNING = threading.Lock()


def _warn_undeclared(app: Any, route: Any, *, phased: bool) -> None:
    """Warn, once per application and once per route, of an OpenAPI schema that will not show
    the key, naming the one line that declares it: an application whose ``openapi`` is a
    function of its own that does not declare them, a route that calls ``run`` unmarked.
    ``app`` is the application whose schema shows ``route`` (a mounted one's own); nothing
    is said where there is no schema (Starlette's, ``openapi_url=None``,
    ``include_in_schema=False``)."""
    if not getattr(app, "openapi_url", None) or not getattr(route, "include_in_schema", True):
        return
    own = getattr(app, "__dict__", {}).get("openapi")
    if own is not None and not getattr(own, _DECLARES, False) and _first_time(app):
        logger.warning(
            "this application's own openapi() shows neither the key header nor the answers of "
            "its idempotent routes in its schema (/docs, generated clients): call "
            "recoverypoint.integrations.fastapi.declare_openapi(app) once, after assigning it"
        )
    endpoint = getattr(route, "endpoint", None)  # not the route: Starlette's compare equal
    if (
        phased
        and endpoint is not None
        and declaration_of(endpoint) is None
        and _first_time(endpoint)
    ):
        logger.warning(
            "%s calls Idempotency.run but is not marked @idempotency.phased() (below the "
            "route's decorator): its OpenAPI schema shows no key header",
            getattr(endpoint, "__qualname__", repr(endpoint)),
        )


def _first_time(warned_of: object) -> bool:
    """Whether nothing was said of ``warned_of`` yet; never, for what cannot be weakly
    referenced (rather a warning never than one at every request)."""
    with _WARNING:
        try:
            if warned_of in _WARNED:
                return False
            _WARNED.add(warned_of)
        except TypeError:
            return False
        return True


# When the scope function runs, for the error that says it failed.
_IN_ROUTE = "in Idempotency.run(), inside the route"
_IN_MIDDLEWARE = (
    "in SingleStepMiddleware, before the route's dependencies (what they put on "
    "request.state is not there yet): derive the scope from the request's headers or from "
    "what an outer middleware set (request.user...)"
)

# Endpoints made single-step, as their routes will find them; endpoints live as long as
# the process, so a plain dict is enough.
_SINGLE_STEPS: dict[Callable[..., Any], tuple[Idempotency, Operation[Any], bool]] = {}


class _Entry:
    """Whether FastAPI called the endpoint, and whether it returned: set by
    :func:`_guarded`, read by the middleware. A mutable object in a context variable, as a
    sync endpoint runs in a copy of the context, in another thread."""

    entered = False
    returned = False


# Set while SingleStepMiddleware runs the application for a single-step endpoint.
_ENTRY: ContextVar[_Entry | None] = ContextVar("recoverypoint_single_step", default=None)


class SingleStepMiddleware:
    """Serves the endpoints made single-step with :meth:`Idempotency.single_step`.

    Add it once, ``app.add_middleware(SingleStepMiddleware)``; any other request passes
    through untouched. For a single-step endpoint it reads the whole body, claims the key
    and calls the application inside the ``responded`` step, capturing what the route
    answered (after FastAPI's validation, ``response_model`` and exception handlers).

    ``max_threads`` bounds the engine calls in flight. They have a thread pool of their own:
    each waits on its endpoint, and a sync endpoint needs a thread of Starlette's pool, so
    sharing one pool could leave every thread waiting for another.
    """

    def __init__(self, app: ASGIApp, *, max_threads: int = 40) -> None:
        self.app = app
        self.limiter = anyio.CapacityLimiter(max_threads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app, route = _route_of(scope) if scope["type"] == "http" else (None, None)
        endpoint = getattr(route, "endpoint", None)
        found = _SINGLE_STEPS.get(endpoint) if endpoint is not None else None
        if found is None:
            await self.app(scope, receive, send)
            return
        idempotency, operation, key_required = found
        _warn_undeclared(app, route, phased=False)
        request = Request(scope)
        try:
            tenant = idempotency._scope_of(request, _IN_MIDDLEWARE, (HTTPException,))
        except HTTPException as exc:  # the application's own refusal, such as a 401
            headers = list((exc.headers or {}).items())
            tenant = http_problem(exc.status_code, exc.detail, headers)
        if isinstance(tenant, Reply):
            await _response(tenant)(scope, receive, send)
            return
        lines = idempotency._key_headers(
            request.headers.getlist(idempotency.key_header), key_required
        )
        if lines is None:
            await _unprotected(self.app, scope, receive, send)
            return
        try:
            # The key first, from the headers: a request without a valid one is refused
            # (400) whatever its body, none of which is read, as the Flask integration does.
            read_key(lines, idempotency.key_header)
            body = await _read_body(request, receive, idempotency.engine.max_params_bytes)
        except (InvalidKey, RequestTooLarge) as exc:
            reply = problem_reply(exc, retry_after=idempotency.retry_after)
            await _response(reply)(scope, receive, send)
            return
        if body is None:
            return  # the client left before sending its body: nobody to answer

        async with anyio.create_task_group() as tasks:
            app = _AppRun(self.app, scope, _replaying(body, receive))

            async def endpoint() -> Captured:
                tasks.start_soon(app.run)
                return await app.response()

            request_of: dict[str, Any] = {
                "scope": tenant,
                "key_headers": lines,
                "method": request.method,
                "target": _target(request),
                "body": lambda: body,
            }
            committed = False
            try:
                if is_async(operation):  # on the event loop, in this task
                    reply, committed = await idempotency._serve_single_step_async(
                        operation, respond=endpoint, **request_of
                    )
                else:
                    serve = functools.partial(
                        idempotency._serve_single_step,
                        operation,
                        respond=lambda: anyio.from_thread.run(endpoint),
                        **request_of,
                    )
                    reply, committed = await anyio.to_thread.run_sync(serve, limiter=self.limiter)
                await _response(reply)(scope, receive, send)
            finally:
                app.go_on(committed)


async def _unprotected(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve a single-step endpoint's request that sent no key where its key is optional:
    the application as it is, its answer marked and logged as unprotected."""

    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            name, value = UNPROTECTED
            headers = [*message.get("headers", []), (name.lower().encode(), value.encode())]
            message = {**message, "headers": headers}
            log_unprotected(scope["method"], _target(Request(scope)), message["status"])
        await send(message)

    _ENTRY.set(_Entry())
    await app(scope, receive, marked)


class _AppRun:
    """The application serving one single-step request, as a task of the middleware's.

    Starlette sends the response, then runs what follows it (background tasks...). The
    last body message hands the response over to the ``responded`` step and holds the
    application there until :meth:`go_on`: after the answer was committed and sent it
    carries on; an answer that was not committed is never followed up (it is cancelled).
    """

    def __init__(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        self.app, self.scope, self.receive = app, scope, receive
        self.entry = _Entry()
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.captured: Captured | None = None
        self.error: Exception | None = None
        self.answered = anyio.Event()
        self.resumed = anyio.Event()
        self.cancel_scope = anyio.CancelScope()

    async def run(self) -> None:
        _ENTRY.set(self.entry)
        with self.cancel_scope:
            try:
                await self.app(self.scope, self.received, self.send)
                self.capture()  # a response whose last body message never came
            except Exception as exc:
                if self.captured is None:
                    self.error = exc
                else:
                    logger.error(
                        "%s %s: the work after its committed answer failed",
                        self.scope["method"],
                        self.scope["path"],
                        exc_info=exc,
                    )
            finally:
                self.answered.set()

    async def received(self) -> Message:
        message = await self.receive()
        if self.captured is not None:
            # Held with the response: a disconnect seen now (our answer completes the
            # exchange) would let Starlette go on before the answer is committed.
            await self.resumed.wait()
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
        elif message["type"] == "http.response.body" and self.captured is None:
            self.chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.capture()
                await self.resumed.wait()

    def capture(self) -> None:
        if self.captured is None and self.start is not None:
            raw = self.start.get("headers", [])
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
            body = b"".join(self.chunks)
            self.captured = Captured(self.start["status"], headers, body, self.entry.entered)
            self.answered.set()

    async def response(self) -> Captured:
        """The response, once its last body message is sent; what the application raised
        if it failed before that. A failure after the endpoint returned (FastAPI's
        ``response_model`` refusing its value) comes after the endpoint's work: the answer
        is then a 500 that says so, stored as the key's, so that no retry does it again."""
        await self.answered.wait()
        if self.captured is None and self.error is not None and self.entry.returned:
            logger.error(
                "%s %s: the endpoint ran, then its response failed; answered and stored 500",
                self.scope["method"],
                self.scope["path"],
                exc_info=self.error,
            )
            refused = problem(500, "response-failed-validation", *_RESPONSE_FAILED)
            return Captured(refused.status, refused.headers, refused.body)
        if self.captured is None:
            raise self.error or RuntimeError("the application returned without a response")
        return self.captured

    def go_on(self, committed: bool) -> None:
        if not committed:
            self.cancel_scope.cancel()
        self.resumed.set()


# The title and detail of the answer stored when the endpoint's response failed after it ran.
_RESPONSE_FAILED = (
    "The response failed validation",
    "The work this request asked for was done, but the response the endpoint returned failed "
    "validation, so it cannot be sent. It is not done again for this Idempotency-Key; the "
    "service's operators have been told.",
)


def _target(request: Request) -> str:
    # From the ASGI scope, not `request.url`: how Starlette's URL escapes the decoded path
    # depends on its version (1.7, the last for Python 3.10, turns the path `/a%3Fb` into
    # the path `/a` and the query `b`).
    return target(request.scope["path"], request.scope.get("query_string", b""))


def _response(reply: Reply) -> Response:
    response = Response(reply.body, reply.status)
    response.raw_headers.extend(
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers
    )
    return response


def _guarded(endpoint: E) -> E:
    """``endpoint``, refusing to run outside :class:`SingleStepMiddleware`.

    The wrapper keeps the endpoint's signature (FastAPI reads it through ``__wrapped__``)
    and its kind, sync or async, so FastAPI calls it the same way.
    """

    def check() -> _Entry:
        entry = _ENTRY.get()
        if entry is None:
            raise RuntimeError(
                f"{endpoint.__qualname__} is single-step: add "
                "app.add_middleware(SingleStepMiddleware) so that its key is claimed"
            )
        entry.entered = True
        return entry

    if inspect.iscoroutinefunction(endpoint):

        @functools.wraps(endpoint)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            entry = check()
            result = await endpoint(*args, **kwargs)
            entry.returned = True
            return result

        guarded_async.__signature__ = _resolved_signature(endpoint)  # type: ignore[attr-defined]
        return guarded_async  # type: ignore[return-value]

    @functools.wraps(endpoint)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        entry = check()
        result = endpoint(*args, **kwargs)
        entry.returned = True
        return result

    guarded.__signature__ = _resolved_signature(endpoint)  # type: ignore[attr-defined]
    return guarded  # type: ignore[return-value]


def _resolved_signature(endpoint: Callable[..., Any]) -> inspect.Signature:
    """``endpoint``'s signature with its annotations evaluated where it was written: older
    FastAPI releases (0.115 among them) evaluate a wrapper's string annotations (``from
    __future__ import annotations``) in the wrapper's module, where the endpoint's models
    are not."""
    try:
        return inspect.signature(endpoint, eval_str=True)
    except (NameError, TypeError):  # a name not defined yet: left as written
        return inspect.signature(endpoint)


def _route_of(scope: Scope) -> tuple[Any, BaseRoute | None]:
    """The route Starlette's router will pick for ``scope`` (the first full match, looking
    inside mounts as the router does), and the application it belongs to: a mounted one's
    own, whose schema shows it."""
    app = scope.get("app")
    routes: Iterable[BaseRoute] = getattr(app, "routes", ())
    while True:
        for route in routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                break
        else:
            return app, None
        nested = getattr(route, "routes", None)
        if not nested:
            return app, route
        app, routes, scope = getattr(route, "app", app), nested, {**scope, **child}


async def _read_body(request: Request, receive: Receive, limit: int) -> bytes | None:
    """The request's body, or None if the client left first. A body past ``limit`` bytes is
    refused (:class:`RequestTooLarge`): unread if its ``Content-Length`` says so, else at
    the message that crosses it; a hostile client cannot make the server hold more."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_over(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_over(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the application: the body already read, then the client's events."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


_declare_every_fastapi_schema()
