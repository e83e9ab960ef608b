"""Everything recoverypoint raises, each error with the HTTP status an integration maps it to.

::

    IdempotencyError                 500  root; never raised itself
    ├── InvalidKey                   400  missing, empty, too long or non-printable key
    ├── InvalidParams                422  params not JSON, too deep, with NUL or a lone surrogate,
    │                                     failing validation; a method or path that cannot be stored
    ├── RequestTooLarge              413  params over the size limit
    ├── ParamsMismatch               422  key reused with another method, path or params
    ├── KeyInUse                     409  another request holds the key's lease (retry_after)
    ├── LockLost                     409  our lease was taken over; our writes rolled back
    ├── ConcurrentUpdate             409  serialization failures outlasted in-process retries
    ├── Retryable                    503  raised by phase code for a transient foreign failure
    ├── DatabaseUnavailable          503  the database failed over, restarted or cannot be
    │                                     reached (retry_after)
    ├── ConfigurationError           500  the service is set up wrongly; no retry helps
    │   ├── OperationNotRegistered   500  the engine does not know the operation (or version)
    │   └── DeclarationError         500  an operation declared wrongly (raised at import time)
    ├── NeedsReconciliation          423  a foreign step's provider forgot its key: the
    │                                     request is held for an operator
    ├── TransactionEnded             500  phase code tried to end the phase's transaction itself
    ├── PhaseLeftScope               500  on Citus, an atomic phase wrote or locked rows
    │                                     outside its scope; nothing committed
    └── AbandonedCall                500  an @idempotent function's key was abandoned

Errors of the 4xx family never leave a row behind. Each class's docstring is its default
message, written for the person who has to act on it.
"""

from __future__ import annotations


class IdempotencyError(Exception):
    """An idempotent request could not be carried out."""

    http_status: int = 500

    def __init__(self, message: str | None = None, *, key: str | None = None) -> None:
        # The docstring, as one line: it is what str(), logs and HTTP answers show.
        self.message = message or " ".join((self.__doc__ or "").split())
        self.key = key
        super().__init__(self.message)


class InvalidKey(IdempotencyError):
    """The idempotency key is missing or invalid: send 1 to 255 printable ASCII characters,
    for example a UUID4."""

    http_status = 400


class InvalidParams(IdempotencyError):
    """The request params cannot be stored: they must be JSON-serialisable, free of NUL
    characters and valid for the operation."""

    http_status = 422


class RequestTooLarge(IdempotencyError):
    """The request params exceed the size limit; send a smaller request."""

    http_status = 413


class ParamsMismatch(IdempotencyError):
    """This idempotency key was already used with another method, path or params: to get
    that request's result, retry it unchanged; use a new key only for a different request."""

    http_status = 422


class KeyInUse(IdempotencyError):
    """A request with this idempotency key is still in progress; retry with the same key
    after the Retry-After delay."""

    http_status = 409

    def __init__(
        self, message: str | None = None, *, key: str | None = None, retry_after: int = 1
    ) -> None:
        super().__init__(message, key=key)
        self.retry_after = retry_after


class LockLost(IdempotencyError):
    """This request's lease on the key expired and another request took it over; its last
    phase was rolled back. Retry with the same key to get the outcome."""

    http_status = 409


class ConcurrentUpdate(IdempotencyError):
    """Concurrent requests kept conflicting on the same rows; retry with the same key."""

    http_status = 409


class Retryable(IdempotencyError):
    """A foreign system failed transiently; retry with the same key."""

    http_status = 503


class DatabaseUnavailable(IdempotencyError):
    """The database is unavailable for a moment (a failover, a restart, a lost connection);
    retry with the same idempotency key after the Retry-After delay: the request resumes
    where it stopped, and nothing it did runs twice."""

    http_status = 503
    retry_after = 1
    """Seconds: a failover or a restart takes a few, and a client retrying sooner only
    finds the key's lease still held."""


class ConfigurationError(IdempotencyError):
    """The service is set up wrongly (its database not migrated, an operation not
    registered, a scope function that fails): no retry succeeds until its operators fix it.
    :meth:`Engine.check` finds what it can at start-up."""


class OperationNotRegistered(ConfigurationError):
    """The operation is not registered with this engine: call engine.register(operation)
    at start-up, and keep older versions registered while their keys are unfinished."""


class DeclarationError(ConfigurationError):
    """The operation is declared wrongly; fix its phases before serving requests."""


class NeedsReconciliation(IdempotencyError):
    """The request is held for the service's operators: it stopped at a step whose
    provider no longer remembers the step's first call, so calling it again could repeat
    it (a second charge). Retrying with this key answers the same until they have found out
    what that call did; do not send the request with another key meanwhile."""

    # 423 Locked: the key is held, by a human's decision still to come. Not 409 or 503,
    # which retrying clients retry, nor 500: nothing failed, and nothing must run again.
    http_status = 423


class TransactionEnded(IdempotencyError):
    """An atomic phase tried to commit or roll back the engine's transaction, which the engine
    commits itself, with the phase's recovery point: the attempt failed and nothing of it was
    recorded. Remove the commit from the phase; a savepoint undoes part of one."""


class PhaseLeftScope(IdempotencyError):
    """An atomic phase wrote (or locked) outside its scope on Citus (another scope's rows, a
    reference table, every shard of a table): on another worker, Citus would have committed
    it by two-phase commit, where SERIALIZABLE does not hold; on its scope's own worker, it
    would fail once a rebalance moved the scopes apart. Refused instead: nothing was
    committed. Name the scope in every statement of a phase, and do cross-tenant work in a
    foreign step or in another operation."""


class AbandonedCall(IdempotencyError):
    """The key's call was abandoned (by the completer after its attempts, or by an operator)
    and answers with this error from now on; call with a new key to try again."""
