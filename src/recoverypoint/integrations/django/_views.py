"""Idempotent Django views: function views, class-based views, DRF ``APIView`` and
``ViewSet`` actions, sync or async.

Single-step views run as the FastAPI and Flask integrations run theirs (see
``recoverypoint.integrations._base``): the view's whole response, its body's exact bytes,
is committed under the key and replayed with ``Idempotent-Replayed: true``; errors are
``application/problem+json`` (400 for a missing or bad key, 409 for a key in flight, 422
for a key reused with another request). What answers before the view's own code runs (a
middleware's 403, ``login_required`` put above the decorator, DRF's authentication and
permission checks, which run before a handler method) leaves no key behind.

An exception the view raises becomes its answer as Django or DRF would make it: ``Http404``,
``PermissionDenied``, ``BadRequest`` and ``SuspiciousOperation``, and in a DRF view every
exception its ``handle_exception`` answers (a serializer's ``ValidationError``...), are the
view's answer, stored and replayed; any other fails the attempt (500), and the client's
retry runs the view again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import (  # type: ignore[import-untyped]
    BadRequest,
    PermissionDenied,
    RequestDataTooBig,
    SuspiciousOperation,
)
from django.core.handlers.exception import response_for_exception  # type: ignore[import-untyped]
from django.db import transaction  # type: ignore[import-untyped]
from django.http import (  # type: ignore[import-untyped]
    Http404,
    HttpRequest,
    HttpResponse,
    RawPostDataException,
)

from ...engine import Engine
from ...errors import ConfigurationError
from ...keys import Unscoped
from ...leases import DEFAULT_LOCK_TIMEOUT
from ...operation import Operation
from .._base import STORED_CLASSES, BaseIdempotency, Captured, body_over, body_params, target
from .._openapi import declared
from .._problem import IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Reply
from ._connection import _DjangoConnections

__all__ = ["Idempotency", "authenticated_user"]

V = TypeVar("V", bound=Callable[..., Any])

# `run` without params: read them from the request's body.
_BODY: Any = object()

# What Django answers itself when a view raises it (django.core.handlers.exception).
_DJANGO_ANSWERS = (Http404, PermissionDenied, BadRequest, SuspiciousOperation)

# When the scope function runs, for the error that says it failed.
_IN_VIEW = "in the view, before the key is claimed (in a DRF view, after its authentication)"


def authenticated_user(request: Any) -> str:
    """The default scope: the authenticated user's primary key. An anonymous request is
    refused (403, ``PermissionDenied``) before any key is looked at: keys of different
    users never collide, and nobody's key is shared by every anonymous client."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise PermissionDenied("log in first: idempotency keys belong to a user")
    return str(user.pk)


class Idempotency(BaseIdempotency[Any]):
    """Runs operations for Django requests and answers with Django responses.

    ``engine`` is usually :func:`~recoverypoint.integrations.django.django_engine`'s, so
    that phases write with the ORM in their own transaction. ``scope`` is called with the
    request (DRF's ``Request`` in a DRF view, once DRF authenticated it); by default
    :func:`authenticated_user`. Raising ``PermissionDenied`` (or a DRF ``APIException``)
    in it refuses the request before any key is looked at; returning ``""`` is the
    service's mistake (a 500 that says so), and ``UNSCOPED`` shares one scope among all
    clients on purpose.

    ``key_header``, ``replayed_header``, ``stored_classes`` and ``wait`` are the FastAPI
    and Flask integrations' (see :class:`~recoverypoint.integrations._base.BaseIdempotency`).
    A waiting duplicate holds its worker thread, and a connection of its own to Django's
    database, while it waits.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        scope: Callable[[Any], str] | Unscoped = authenticated_user,
        retry_after: int = 1,
        key_header: str = IDEMPOTENCY_KEY,
        replayed_header: str = IDEMPOTENT_REPLAYED,
        stored_classes: Collection[int] = STORED_CLASSES,
        wait: timedelta | float | None = None,
    ) -> None:
        # No async engine: an async view reaches the engine on the thread of Django's
        # connection, which the ORM in its phases needs.
        super().__init__(
            engine,
            scope=scope,
            retry_after=retry_after,
            key_header=key_header,
            replayed_header=replayed_header,
            stored_classes=stored_classes,
            wait=wait,
        )
        if "_" in self.key_header:
            # WSGI turns "-" into "_": X_Key and X-Key would be one header to Django, whose
            # own server drops a name with "_" for that reason.
            raise ValueError(
                f"key_header {key_header!r}: Django cannot tell '_' from '-' in a header "
                "name (its server drops names with '_'); use '-'"
            )
        self._key_meta = "HTTP_" + self.key_header.upper().replace("-", "_")

    def run(
        self,
        operation: Operation[Any],
        request: Any,
        params: Any = _BODY,
        *,
        key_required: bool = True,
    ) -> HttpResponse:
        """Run ``operation`` for ``request`` with ``params``; without them, with the
        request's body, read as JSON (or else text): too large (413), nested too deep or
        undecodable (422) is refused. Call it from a view (any kind); in an async view,
        ``await idempotency.arun(...)``. With ``key_required=False`` a request that sends
        no key runs unprotected (under a key of its own, which no retry can name), its
        answer marked ``Idempotent-Unprotected: true``."""
        http = _http(request)
        scope = self._scope_of(request, _IN_VIEW, _refusals())
        if isinstance(scope, Reply):
            return _response(scope)
        limit = self.engine.max_params_bytes
        reply = self._serve(
            operation,
            scope=scope,
            key_headers=self._key_headers(self._key_lines(http), key_required),
            method=http.method,
            target=_target(http),
            params=lambda: body_params(_body(http, limit), limit) if params is _BODY else params,
        )
        return _response(reply)

    async def arun(
        self,
        operation: Operation[Any],
        request: Any,
        params: Any = _BODY,
        *,
        key_required: bool = True,
    ) -> HttpResponse:
        """:meth:`run` for an async view: on the thread of Django's connection."""
        run = functools.partial(self.run, key_required=key_required)
        return await sync_to_async(run)(operation, request, params)

    def single_step(
        self,
        name: str,
        *,
        lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
        key_required: bool = True,
        dedupe_window: timedelta | None = None,
    ) -> Callable[[V], V]:
        """Make a view single-step: its whole response is stored under the key and replayed.
        ``name`` is the operation's stable name; renaming the function keeps it.

        Decorate a function view, ``async def`` included, or a method of a class-based view
        or of a DRF ``APIView``/``ViewSet`` (``post``, ``create``, an ``@action``), directly
        or through ``method_decorator``; put access checks (``login_required``...) above it,
        so that their refusals leave no key. With ``key_required=False`` a request that
        sends no key runs the view unprotected (nothing stored), its answer marked
        ``Idempotent-Unprotected: true``.

        ``dedupe_window``: how long the services the view calls remember an idempotency
        key (Stripe: 24 hours). Once that long has passed since a request's first run began,
        a retry of the unfinished key never runs the view blindly again: it answers 423
        (needs reconciliation) and the key waits for ``recoverypoint keys reconcile``.
        """
        operation = self._declare_single_step(name, lock_timeout, dedupe_window)

        def decorate(view: V) -> V:
            def serve(run_view: Callable[..., Any], args: Any, kwargs: Any) -> HttpResponse:
                instance, request = _split(view, args)
                http = _http(request)

                def respond() -> Captured:
                    try:
                        response = run_view(*args, **kwargs)
                    except Exception as exc:
                        response = _answer(instance, request, exc)
                    return _captured(_finished(instance, request, response))

                scope = self._scope_of(request, _IN_VIEW, _refusals())
                if isinstance(scope, Reply):
                    return _response(scope)
                lines = self._key_headers(self._key_lines(http), key_required)
                limit = self.engine.max_params_bytes
                reply, _ = self._serve_single_step(
                    operation,
                    scope=scope,
                    key_headers=lines,
                    method=http.method,
                    target=_target(http),
                    body=lambda: _body(http, limit),
                    respond=respond,
                )
                return _response(reply)

            wrapped: Callable[..., Any]
            if inspect.iscoroutinefunction(view):
                # The engine runs on the thread of Django's connection, the view back on
                # the event loop: asgiref nests the two.
                serve_in_thread = sync_to_async(serve)

                @functools.wraps(view)
                async def single_step_async(*args: Any, **kwargs: Any) -> HttpResponse:
                    return await serve_in_thread(async_to_sync(view), args, kwargs)

                wrapped = single_step_async
            else:

                @functools.wraps(view)
                def single_step_view(*args: Any, **kwargs: Any) -> HttpResponse:
                    return serve(view, args, kwargs)

                wrapped = single_step_view
            return declared(self._non_atomic(wrapped), self._declaration(key_required))  # type: ignore[return-value]

        return decorate

    def _key_lines(self, request: HttpRequest) -> list[str]:
        """The key header's value, as a list of lines: the server joins a header sent twice
        with ", ", in which :func:`~recoverypoint.integrations._problem.read_key` then
        finds two keys."""
        value = request.META.get(self._key_meta)
        return [] if value is None else [value]

    def _non_atomic(self, view: Callable[..., Any]) -> Callable[..., Any]:
        """``view``, kept out of ``ATOMIC_REQUESTS``'s transaction: the engine commits each
        phase itself. (A method's class-based view needs ``non_atomic_requests`` on its
        ``as_view()``; run inside an atomic block the engine refuses, saying so.)"""
        pool = self.engine.db.pool
        if isinstance(pool, _DjangoConnections):
            return transaction.non_atomic_requests(using=pool.using)(view)  # type: ignore[no-any-return]
        return view


def _refusals() -> tuple[type[Exception], ...]:
    """What a scope function raises to refuse a request: Django's own refusals, and DRF's
    (then answered by DRF) when it is installed."""
    try:
        from rest_framework.exceptions import APIException  # type: ignore[import-untyped]
    except ImportError:
        return _DJANGO_ANSWERS
    return (*_DJANGO_ANSWERS, APIException)


def _is_request(value: Any) -> bool:
    return isinstance(value, HttpRequest) or isinstance(
        getattr(value, "_request", None), HttpRequest
    )


def _split(view: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """The view's instance (``None`` for a function view) and its request."""
    if args and _is_request(args[0]):
        # A function view; or a method that Django's method_decorator hands over bound.
        return getattr(getattr(view, "func", None), "__self__", None), args[0]
    if len(args) > 1 and _is_request(args[1]):
        return args[0], args[1]
    raise TypeError(
        f"{view.__qualname__} is not called as a view: decorate a function whose first "
        "argument is the request, or a view method (self, request, ...)"
    )


def _http(request: Any) -> HttpRequest:
    """Django's HttpRequest, of a DRF Request too."""
    return request if isinstance(request, HttpRequest) else request._request


def _answer(instance: Any, request: Any, exc: Exception) -> HttpResponse:
    """The answer Django or DRF gives for ``exc``; re-raised when neither has one (the
    attempt failed)."""
    handle = getattr(instance, "handle_exception", None)
    if handle is not None and hasattr(instance, "finalize_response"):  # DRF's
        return handle(exc)
    if isinstance(exc, _DJANGO_ANSWERS):
        return response_for_exception(_http(request), exc)
    raise exc


def _finished(instance: Any, request: Any, response: Any) -> HttpResponse:
    """The response as the client would receive it: a DRF Response finalized (its renderer
    chosen), a template response rendered."""
    finalize = getattr(instance, "finalize_response", None)
    if finalize is not None:
        response = finalize(request, response)
    if callable(getattr(response, "render", None)) and not response.is_rendered:
        response.render()
    return response


def _captured(response: HttpResponse) -> Captured:
    headers = list(response.items())
    # Django keeps cookies apart from the headers; the first answer carries them.
    headers += [
        ("Set-Cookie", morsel.output(header="").strip()) for morsel in response.cookies.values()
    ]
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return Captured(response.status_code, headers, body)


def _body(request: HttpRequest, limit: int) -> bytes:
    """The request's body, refused past ``limit`` bytes before it is read whole."""
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > limit:
        raise body_over(limit)
    try:
        body: bytes = request.body
    except RequestDataTooBig:  # past Django's own DATA_UPLOAD_MAX_MEMORY_SIZE
        raise body_over(limit) from None
    except RawPostDataException:
        raise ConfigurationError(
            "the request's multipart body was parsed before the view (request.POST read by "
            "a middleware), so its bytes are gone and cannot be fingerprinted: keep "
            "multipart forms out of idempotent views, or read request.POST after them"
        ) from None
    if len(body) > limit:
        raise body_over(limit)
    return body


def _target(request: HttpRequest) -> str:
    return target(request.path, request.META.get("QUERY_STRING", "").encode("latin-1"))


def _response(reply: Reply) -> HttpResponse:
    response = HttpResponse(reply.body, status=reply.status)
    # Django gives every response a text/html Content-Type; ours come with their own, or
    # have no body.
    del response["Content-Type"]
    for name, value in reply.headers:
        if name.lower() == "set-cookie":
            response.cookies.load(value)
        elif name in response:  # a field sent twice, joined as RFC 9110 §5.3 allows
            response[name] = f"{response[name]}, {value}"
        else:
            response[name] = value
    return response
