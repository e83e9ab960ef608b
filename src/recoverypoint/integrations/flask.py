"""Flask: idempotent views that answer as the IETF draft says.

Install with ``pip install 'recoverypoint[flask]'``.

A phased operation::

    idempotency = Idempotency(engine, scope=lambda request: str(g.user.id))

    @app.post("/rides")
    def post_ride() -> Response:
        return idempotency.run(rides)  # the params: the request's JSON body

A single-step view (see ``recoverypoint.integrations._base``)::

    @app.post("/orders")
    @idempotency.single_step("create_order")
    def create_order() -> tuple[dict[str, Any], int]: ...

An exception the view raises becomes its answer as Flask would make it: ``abort(409)``
(any werkzeug ``HTTPException``) and an exception the application has an error handler
for are the view's answer, stored and replayed; any other fails the attempt (500), and the
client's retry runs the view again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import flask
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from ..leases import DEFAULT_LOCK_TIMEOUT
from ..operation import Operation
from ._base import BaseIdempotency, Captured, body_over, body_params, target
from ._problem import Reply

__all__ = ["Idempotency"]

# When the scope function runs, for the error that says it failed.
_IN_VIEW = "in the view, before the key is claimed"

V = TypeVar("V", bound=Callable[..., Any])

# `run` without params: read them from the request's body.
_BODY: Any = object()


class Idempotency(BaseIdempotency[flask.Request]):
    """Runs operations for the current Flask request and answers with Flask responses.

    ``scope`` is called with :data:`flask.request`, inside the request context (``g`` is
    there too); ``abort(401)`` in it refuses the request before any key is looked at.
    """

    def run(
        self, operation: Operation[Any], params: Any = _BODY, *, key_required: bool = True
    ) -> flask.Response:
        """Run ``operation`` for the current request with ``params``; without them, with the
        request's body, read as JSON (or else text) so that a body too large (413), nested
        too deep or undecodable (422) is refused rather than a 500 from ``get_json()``.

        Errors become ``application/problem+json`` answers; a replay carries
        ``Idempotent-Replayed: true``. With ``key_required=False`` a request that sends no
        key runs unprotected (under a key of its own, which no retry can name), its answer
        marked ``Idempotent-Unprotected: true``.
        """
        request = flask.request
        limit = self.engine.max_params_bytes
        scope = self._scope_of(request, _IN_VIEW, (HTTPException,))
        if isinstance(scope, Reply):
            return _response(scope)
        reply = self._serve(
            operation,
            scope=scope,
            key_headers=self._key_headers(request.headers.getlist(self.key_header), key_required),
            method=request.method,
            target=_target(request),
            params=lambda: body_params(_body(request, limit), limit) if params is _BODY else params,
        )
        return _response(reply)

    def single_step(
        self,
        name: str,
        *,
        lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
        key_required: bool = True,
        dedupe_window: timedelta | None = None,
    ) -> Callable[[V], V]:
        """Make a view single-step: its whole response is stored under the key and
        replayed. ``name`` is the operation's stable name; renaming the function keeps it.
        Put it below ``@app.post(...)``, so that the route gets the decorated view.

        With ``key_required=False`` a request that sends no key runs the view unprotected
        (nothing stored), its answer marked ``Idempotent-Unprotected: true``.

        ``dedupe_window``: how long the services the view calls remember an idempotency
        key (Stripe: 24 hours). Once that long has passed since a request's first run began,
        a retry of the unfinished key never runs the view blindly again: it answers 423
        (needs reconciliation) and the key waits for ``recoverypoint keys reconcile``.
        """
        operation = self._declare_single_step(name, lock_timeout, dedupe_window)

        def decorate(view: V) -> V:
            @functools.wraps(view)
            def single_step_view(*args: Any, **kwargs: Any) -> flask.Response:
                request = flask.request

                def respond() -> Captured:
                    app = flask.current_app
                    try:
                        # ensure_sync: an async view runs as Flask would run it.
                        rv = app.ensure_sync(view)(*args, **kwargs)
                    except Exception as exc:
                        # The error handlers Flask would run, abort()'s included; an
                        # exception none handles propagates: the attempt failed.
                        rv = app.handle_user_exception(exc)
                    response = app.make_response(rv)
                    return Captured(
                        response.status_code, list(response.headers.items()), response.get_data()
                    )

                limit = self.engine.max_params_bytes
                scope = self._scope_of(request, _IN_VIEW, (HTTPException,))
                if isinstance(scope, Reply):
                    return _response(scope)
                lines = self._key_headers(request.headers.getlist(self.key_header), key_required)
                reply, _ = self._serve_single_step(
                    operation,
                    scope=scope,
                    key_headers=lines,
                    method=request.method,
                    target=_target(request),
                    body=lambda: _body(request, limit),
                    respond=respond,
                )
                return _response(reply)

            return single_step_view  # type: ignore[return-value]

        return decorate


def _body(request: flask.Request, limit: int) -> bytes:
    """The request's body, refused past ``limit`` bytes (or the application's own lower
    ``max_content_length``) before it is read whole. werkzeug refuses a ``Content-Length``
    over the request's ``max_content_length`` unread, and stops reading a stream without one
    there, silently: so that cap is set one byte past the limit, and a body that reaches it
    is over."""
    own = request.max_content_length
    if own is not None and own < limit:
        limit = own
    if (request.content_length or 0) > limit:
        raise body_over(limit)  # also where a hook opened the stream before this cap was set
    request.max_content_length = limit + 1
    try:
        body = request.get_data()
    except RequestEntityTooLarge:
        raise body_over(limit) from None
    if len(body) > limit:
        raise body_over(limit)
    return body


def _target(request: flask.Request) -> str:
    return target(request.path, request.query_string)


def _response(reply: Reply) -> flask.Response:
    response = flask.Response(reply.body, reply.status)
    # Flask gives every response a text/html Content-Type; ours come with their own, or
    # have no body.
    del response.headers["Content-Type"]
    response.headers.extend(reply.headers)
    return response
