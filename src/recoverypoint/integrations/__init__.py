"""Integrations with other libraries, each imported on its own and the only module to import
its library (this package imports none of them).

- web frameworks: FastAPI/Starlette (:mod:`.fastapi`), Flask (:mod:`.flask`), and Django
  with Django REST framework (:mod:`.django`, whose engine runs on Django's own connection);
- job backends: Celery (:mod:`.celery`).

What the web integrations share, and what a client can rely on:

=============================================  ======  =================================
situation                                      status  extra headers
=============================================  ======  =================================
a new key: the operation's own response        any
a finished key: the stored response            any     ``Idempotent-Replayed: true``
no key, where the route made it optional       any     ``Idempotent-Unprotected: true``
refused before a single-step endpoint ran (*)  any
``Idempotency-Key`` missing, repeated, bad     400
params too large                               413
params unusable, or key reused with others     422
the key is in flight (or a lease was lost)     409     ``Retry-After``
a foreign system failed (``rp.Retryable``)     503     ``Retry-After``
the database is unavailable (a failover...)    503     ``Retry-After``
anything unexpected                            500
=============================================  ======  =================================

(*) FastAPI's own answers given before it calls the endpoint: an auth dependency's 401, a
422 for a body that fails validation; Django's middleware and DRF's authentication and
permission checks. They are sent as they are and leave no key behind.

The key is read as the IETF draft writes it, a Structured Field String (``"8e03978e-…"``,
parameters allowed), or bare as Stripe's clients send it (``8e03978e-…``); see
:func:`~recoverypoint.integrations._problem.read_key` for the exact rule.

The header names are the integration's ``key_header`` and ``replayed_header`` (the draft's
and Stripe's by default); which single-step answers are stored, by status class, its
``stored_classes`` (all by default); with ``wait=`` a duplicate waits (at most a minute)
for the first request's answer instead of a 409. A scope function must name an owner: one
that returns ``""`` is a 500 that says so; ``scope=UNSCOPED`` shares one scope among all
clients, on purpose.

Errors are ``application/problem+json`` (RFC 9457); their ``type`` is
``tag:recoverypoint,2025:<error>`` (``key-in-use``, ``params-mismatch``...). The 500 tells
the client to retry with the same key and carries no server detail; the server logs it on
the ``recoverypoint.http`` logger.
"""

from ..keys import UNSCOPED
from ._problem import IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IDEMPOTENT_UNPROTECTED, RETRY_AFTER

__all__ = [
    "IDEMPOTENCY_KEY",
    "IDEMPOTENT_REPLAYED",
    "IDEMPOTENT_UNPROTECTED",
    "RETRY_AFTER",
    "UNSCOPED",
]
