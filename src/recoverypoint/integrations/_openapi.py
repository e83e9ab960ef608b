"""The schema a client sees: what an idempotent route declares in OpenAPI 3, free of any
web framework.

An endpoint served through an integration carries a :class:`Declaration` (set by
``single_step``, or by ``phased`` for a route that calls ``run``); the framework's schema
hook (``FastAPI.openapi``, which ``recoverypoint.integrations.fastapi`` wraps;
drf-spectacular's extension in ``recoverypoint.integrations.django``) finds it and calls
:func:`declare` on the route's operation:

- the key header, as :func:`~recoverypoint.integrations._problem.read_key` accepts it: a bare
  key (``8e03978e-40d5``) or a quoted one (``"8e03978e-40d5"``), 1 to 255 printable ASCII
  characters; so a client generated from the schema sends it, and sends nothing it refuses;
- ``Idempotent-Replayed`` (and ``Idempotent-Unprotected`` where the key is optional) on the
  route's own answers, which are the ones stored and replayed;
- the ``application/problem+json`` answers of the integration, with ``Retry-After`` on 409
  and 503.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..keys import MAX_KEY_LENGTH
from ._problem import IDEMPOTENT_UNPROTECTED, PROBLEM_JSON, RETRY_AFTER

__all__ = ["PROBLEM_SCHEMA", "Declaration", "declaration_of", "declare", "declared"]

F = TypeVar("F", bound=Callable[..., Any])

# A bare key: printable ASCII but for space, '"', ',' and ';' (which would make it two keys,
# a quoted key gone wrong or a key with parameters). A quoted key: an sf-string (RFC 8941
# §3.3.3) of 1 to 255 characters, '\"' and '\\' counting as one.
KEY_PATTERN = (
    rf"^(?:[-!#-+.-:<-~]{{1,{MAX_KEY_LENGTH}}}"
    rf'|"(?:[ !#-\[\]-~]|\\["\\]){{1,{MAX_KEY_LENGTH}}}")$'
)
# Bare text that is an Integer, a Decimal, a Boolean or a Byte Sequence Item (valid base64,
# padding optional), whose value is not its text: refused.
NOT_A_STRING_ITEM = (
    r"^(?:-?[0-9]{1,15}|-?[0-9]{1,12}\.[0-9]{1,3}|\?[01]"
    r"|:(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}={0,2}|[A-Za-z0-9+/]{3}=?)?:)$"
)

PROBLEM_COMPONENT = "IdempotencyProblem"
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An error, as RFC 9457 writes it.",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": "What went wrong, as a URI."},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string", "description": "What to do next."},
    },
}

# The integration's own answers (all problem+json), with what each tells the client.
_PROBLEMS: dict[str, str] = {
    "400": "The {key} header is missing, sent twice or invalid.",
    "409": "A request with this key is still in progress: retry with the same key after "
    "Retry-After seconds.",
    "413": "The request body is over the size limit.",
    "422": "This key was already used with another method, path or body.",
    "423": "The request is held for the service's operators, who must find out what an earlier "
    "attempt did; retrying with this key answers the same until they have.",
    "503": "The service is unavailable for a moment: retry with the same key after "
    "Retry-After seconds.",
}
_RETRY_AFTER = {
    "required": True,
    "description": "Seconds to wait before retrying with the same key.",
    "schema": {"type": "integer", "minimum": 1},
}

_ATTRIBUTE = "__recoverypoint_declaration__"


@dataclass(frozen=True)
class Declaration:
    """What an endpoint served through an integration declares."""

    key_header: str
    replayed_header: str
    key_required: bool


def declared(endpoint: F, declaration: Declaration) -> F:
    """``endpoint``, marked with ``declaration``. An attribute, not a registry: decorators
    that wrap the endpoint (``functools.wraps``, Django's ``method_decorator``) carry it."""
    setattr(endpoint, _ATTRIBUTE, declaration)
    return endpoint


def declaration_of(endpoint: object) -> Declaration | None:
    found = getattr(endpoint, _ATTRIBUTE, None)
    return found if isinstance(found, Declaration) else None


def declare(operation: dict[str, Any], declaration: Declaration, problem_ref: str) -> None:
    """Add ``declaration`` to an OpenAPI operation object, in place. ``problem_ref`` is the
    ``$ref`` of :data:`PROBLEM_SCHEMA` in the document's components."""
    key = declaration.key_header
    parameters = [
        p
        for p in operation.get("parameters", [])
        if not (p.get("in") == "header" and str(p.get("name", "")).lower() == key.lower())
    ]
    operation["parameters"] = [*parameters, _key_parameter(declaration)]
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for status, response in responses.items():
        # A replay repeats an answer of the route's own; the refusals below are never stored.
        if str(status) not in _PROBLEMS:
            response.setdefault("headers", {}).update(_answer_headers(declaration))
    for status, text in _PROBLEMS.items():
        ours = text.format(key=key)
        response = responses.setdefault(status, {"description": ours})
        if response["description"] != ours:  # the route's own answer of this status, or ours
            response["description"] = f"{response['description'].rstrip('.')}; or {ours}"
        content = response.setdefault("content", {})
        content[PROBLEM_JSON] = {"schema": {"$ref": problem_ref}}
        if status in ("409", "503"):
            response.setdefault("headers", {})[RETRY_AFTER] = copy.deepcopy(_RETRY_AFTER)


def _key_parameter(declaration: Declaration) -> dict[str, Any]:
    return {
        "name": declaration.key_header,
        "in": "header",
        "required": declaration.key_required,
        "description": (
            "A key of your own for this request, such as a UUID4, sent unchanged on every "
            "retry: the request runs once and each retry gets its answer. 1 to "
            f"{MAX_KEY_LENGTH} printable ASCII characters, bare or in double quotes."
            + (
                ""
                if declaration.key_required
                else " Without it the request runs unprotected: a retry may run it again."
            )
        ),
        "schema": {
            "type": "string",
            "pattern": KEY_PATTERN,
            "not": {"pattern": NOT_A_STRING_ITEM},
            "example": "8e03978e-40d5-43e8-bc93-6894a57f9324",
        },
    }


def _answer_headers(declaration: Declaration) -> dict[str, Any]:
    headers = {
        declaration.replayed_header: {
            "description": "true when this is the stored answer to an earlier request with "
            "the same key: a replay; the request did not run again.",
            "schema": {"type": "string", "enum": ["true"]},
        }
    }
    if not declaration.key_required:
        headers[IDEMPOTENT_UNPROTECTED] = {
            "description": "true when the request sent no key and ran unprotected.",
            "schema": {"type": "string", "enum": ["true"]},
        }
    return headers
