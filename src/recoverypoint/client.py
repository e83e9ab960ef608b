"""A retrying HTTP client for idempotent APIs, on httpx (``pip install 'recoverypoint[client]'``).

Each call is one logical request: it gets one ``Idempotency-Key`` (a new UUID4, or the one
you pass), sent unchanged on every attempt, so the server runs it once however many times
it is sent. Attempts are retried after a connection error (refused, reset, dropped before
the whole answer arrived, timed out) and after a 409, 429 or 5xx answer, waiting between
attempts:

- exponential backoff with full jitter: a random delay between 0 and
  ``min(max_delay, base_delay * 2**retry)``, so clients that failed together spread out;
- never less than the answer's ``Retry-After`` (seconds or an HTTP date);
- at most ``max_attempts`` attempts, and no new attempt once ``total_timeout`` seconds
  have passed since the first began (or would pass during the wait).

Then the last answer is returned, or the last connection error raised. Other answers are
returned at once: a 4xx other than 409, 423 and 429 needs a changed request, hence a new
key; a replayed answer (``Idempotent-Replayed: true``) is final, even a stored 5xx.

A 423 (Locked: the server holds the request for its operators' reconciliation, as its
problem's ``detail`` says) is final for that key, and the request must never be sent with
another: that could repeat the step the operators are looking into (a second charge). So a
client remembers the requests answered 423 (method, URL, ``params`` and body), and sending
one again without a key sends it with its key, never a new one; the server answers the
same until its operators have reconciled it, then the request's own answer.

The policy (:class:`RetryPolicy`, :class:`Attempts`) does no I/O; :class:`Client` and
:class:`AsyncClient` are thin shells that send, sleep and ask it what to do next.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any

import anyio
import httpx

from .integrations import IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_AFTER

__all__ = ["AsyncClient", "Attempts", "Client", "Retry", "RetryPolicy"]

# The transport errors after which the same request may succeed; a malformed URL or an
# unsupported scheme (also TransportErrors) will not.
RETRIABLE_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)


def retriable_status(status: int) -> bool:
    """409: the key is in flight; 429: too many requests; 5xx: the server failed."""
    return status in (409, 429) or status >= 500


@dataclass(frozen=True)
class RetryPolicy:
    """How a logical request is retried; every duration is in seconds.

    The defaults ride out a server that is away for about half a minute (a restart, a
    deploy, a failover): up to 10 attempts, the waits' ceiling doubling from 0.5 s to
    10 s, about 28 s of waiting in all on average (55 s at most), all within a minute
    of the first attempt. An interactive caller that would rather fail fast sets fewer
    attempts or a shorter ``total_timeout``.
    """

    max_attempts: int = 10
    base_delay: float = 0.5
    max_delay: float = 10.0
    total_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if min(self.base_delay, self.max_delay, self.total_timeout) < 0:
            raise ValueError("delays and total_timeout cannot be negative")


@dataclass(frozen=True)
class Retry:
    """One retry about to happen, as reported to ``on_retry``."""

    key: str
    attempt: int
    """The attempt that failed, from 1."""
    delay: float
    """Seconds until the next attempt."""
    status: int | None
    """The answer's status, or ``None`` after a connection error."""
    error: Exception | None


@dataclass
class Attempts:
    """The attempts of one logical request: decides, without I/O, whether and when to retry.

    ``clock`` (seconds, monotonic) and ``rng`` are there for tests.
    """

    policy: RetryPolicy
    key: str
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    made: int = 0
    started: float = 0.0

    def begin(self) -> None:
        """Call before each attempt."""
        if self.made == 0:
            self.started = self.clock()
        self.made += 1

    def after_response(
        self, status: int, retry_after: str | None, replayed: bool = False
    ) -> Retry | None:
        """The retry to make after an answer, or ``None`` to return it. A replayed answer
        (``Idempotent-Replayed: true``) is the request's final one, 5xx or not; so is a
        423, until the server's operators reconcile the request."""
        if replayed or not retriable_status(status):
            return None
        return self._retry(status, None, _parse_retry_after(retry_after))

    def after_error(self, error: Exception) -> Retry | None:
        """The retry to make after a transport error, or ``None`` to raise it."""
        if not isinstance(error, RETRIABLE_ERRORS):
            return None
        return self._retry(None, error, 0.0)

    def _retry(self, status: int | None, error: Exception | None, floor: float) -> Retry | None:
        if self.made >= self.policy.max_attempts:
            return None
        ceiling = min(self.policy.max_delay, self.policy.base_delay * 2.0 ** (self.made - 1))
        delay = max(floor, self.rng.uniform(0, ceiling))
        if self.clock() + delay - self.started > self.policy.total_timeout:
            return None
        return Retry(self.key, self.made, delay, status, error)


def _parse_retry_after(value: str | None) -> float:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 §10.2.3); 0 if unusable."""
    if not value:
        return 0.0
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


HELD = 423
"""The status of a request the server holds for reconciliation
(:class:`~recoverypoint.NeedsReconciliation`)."""

# How many held requests a client remembers.
_HELD_KEPT = 1000

# What a request sends besides its method, URL and headers.
_SENT = ("params", "content", "data", "files", "json")


class _Held:
    """The keys of the requests answered :data:`HELD`, by what the request sends: a request
    sent again without a key gets its key back instead of a new one, until it gets another
    answer (reconciled, the key answers what its request did; a later request that sends
    the same is a new one). Only this client's, and the last :data:`_HELD_KEPT` of them."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str], str] = {}

    @staticmethod
    def _request(method: str, url: str, kwargs: dict[str, Any]) -> tuple[str, str, str]:
        return method.upper(), str(url), repr([kwargs.get(name) for name in _SENT])

    def key(self, method: str, url: str, kwargs: dict[str, Any]) -> str | None:
        return self._keys.get(self._request(method, url, kwargs)) if self._keys else None

    def answered(
        self, method: str, url: str, kwargs: dict[str, Any], key: str, status: int
    ) -> None:
        if not self._keys and status != HELD:
            return  # nothing held: no work per request
        request = self._request(method, url, kwargs)
        self._keys.pop(request, None)
        if status == HELD:
            self._keys[request] = key
            if len(self._keys) > _HELD_KEPT:  # the oldest first: dicts keep their order
                del self._keys[next(iter(self._keys))]


def _with_key(
    kwargs: dict[str, Any], key: str | None, held: str | None = None
) -> tuple[str, dict[str, Any]]:
    key = key or held or str(uuid.uuid4())
    headers = _headers(kwargs.pop("headers", None))
    headers[IDEMPOTENCY_KEY] = key
    return key, {**kwargs, "headers": headers}


def _headers(given: Any) -> httpx.Headers:
    """``given`` as httpx's headers; text that is not ASCII is refused saying which header
    and which character (httpx's own error names neither)."""
    try:
        return httpx.Headers(given)
    except UnicodeEncodeError:
        pairs = given.items() if hasattr(given, "items") else given
        for name, value in pairs:
            for what, text in (("name", name), ("value", value)):
                if isinstance(text, str) and not text.isascii():
                    at = next(i for i, char in enumerate(text) if not char.isascii())
                    raise ValueError(
                        f"the {what} of header {name!r} holds {text[at]!r} (U+{ord(text[at]):04X}) "
                        f"at position {at}: HTTP headers carry ASCII text, so replace it, "
                        "or encode the value (percent-encoding, base64) as the server expects"
                    ) from None
        raise


class Client:
    """A synchronous retrying client; ``httpx_options`` go to :class:`httpx.Client`.

    ``on_retry`` is called before each wait, with what failed and how long the wait is.
    """

    def __init__(
        self,
        base_url: str = "",
        *,
        policy: RetryPolicy | None = None,
        on_retry: Callable[[Retry], None] | None = None,
        **httpx_options: Any,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.on_retry = on_retry
        self._held = _Held()
        if "headers" in httpx_options:
            httpx_options["headers"] = _headers(httpx_options["headers"])
        self.http = httpx.Client(base_url=base_url, **httpx_options)

    def request(
        self, method: str, url: str, *, idempotency_key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send one logical request, retried under one key; ``kwargs`` as for httpx."""
        key, kwargs = _with_key(kwargs, idempotency_key, self._held.key(method, url, kwargs))
        attempts = Attempts(self.policy, key)
        while True:
            attempts.begin()
            try:
                response = self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                retry = attempts.after_error(exc)
                if retry is None:
                    raise
            else:
                retry = attempts.after_response(
                    response.status_code,
                    response.headers.get(RETRY_AFTER),
                    response.headers.get(IDEMPOTENT_REPLAYED) == "true",
                )
                if retry is None:
                    self._held.answered(method, url, kwargs, key, response.status_code)
                    return response
            if self.on_retry is not None:
                self.on_retry(retry)
            time.sleep(retry.delay)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient:
    """Async version of :class:`Client`, on :class:`httpx.AsyncClient`."""

    def __init__(
        self,
        base_url: str = "",
        *,
        policy: RetryPolicy | None = None,
        on_retry: Callable[[Retry], None] | None = None,
        **httpx_options: Any,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.on_retry = on_retry
        self._held = _Held()
        if "headers" in httpx_options:
            httpx_options["headers"] = _headers(httpx_options["headers"])
        self.http = httpx.AsyncClient(base_url=base_url, **httpx_options)

    async def request(
        self, method: str, url: str, *, idempotency_key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send one logical request, retried under one key; ``kwargs`` as for httpx."""
        key, kwargs = _with_key(kwargs, idempotency_key, self._held.key(method, url, kwargs))
        attempts = Attempts(self.policy, key)
        while True:
            attempts.begin()
            try:
                response = await self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                retry = attempts.after_error(exc)
                if retry is None:
                    raise
            else:
                retry = attempts.after_response(
                    response.status_code,
                    response.headers.get(RETRY_AFTER),
                    response.headers.get(IDEMPOTENT_REPLAYED) == "true",
                )
                if retry is None:
                    self._held.answered(method, url, kwargs, key, response.status_code)
                    return response
            if self.on_retry is not None:
                self.on_retry(retry)
            await anyio.sleep(retry.delay)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", url, **kwargs)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
