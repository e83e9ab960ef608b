"""The Rocket Rides API: ``POST /rides`` books a ride and charges for it, exactly once.

Before any key is stored: ``Authorization: Bearer <email>`` must name a user (401), and
the body must hold valid coordinates (422). Then the ``create_ride`` operation runs under
the client's ``Idempotency-Key``, scoped to the user:

1. ``ride_created`` (atomic): the ride and its audit record;
2. ``charge_created`` (foreign): 2000 usd through the provider, with the downstream key
   (and nothing of the ride's: see :func:`_charge`).
   A declined card finishes the key with 402; an unreachable or failing provider raises
   ``Retryable`` (503), and the client's retry resumes here with the same downstream key,
   so the provider never charges twice;
3. ``finished`` (atomic): the charge recorded on the ride, a ``send_ride_receipt`` job
   staged, and ``201 {ride_id, charge_id}``.
"""

from __future__ import annotations

from contextvars import ContextVar
from datetime import timedelta
from typing import Annotated, Any

import httpx
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

import recoverypoint as rp
from recoverypoint.integrations.fastapi import Idempotency

AMOUNT, CURRENCY = 2000, "usd"


class RideBody(BaseModel):
    # Strict: a body its schema refuses (`false` for a coordinate) is refused, not coerced.
    model_config = ConfigDict(strict=True)

    origin_lat: float = Field(ge=-90, le=90)
    origin_lon: float = Field(ge=-180, le=180)
    target_lat: float = Field(ge=-90, le=90)
    target_lon: float = Field(ge=-180, le=180)


class RideBooked(BaseModel):
    ride_id: int
    charge_id: str


class Refusal(BaseModel):
    """FastAPI's answer to an ``HTTPException``."""

    detail: str


class Declined(BaseModel):
    error: str
    message: str


# The API's own answers, for its schema; the key's and the integration's are declared by
# `phased`.
_ANSWERS: dict[int | str, dict[str, Any]] = {
    201: {"model": RideBooked, "description": "The ride is booked and charged."},
    400: {"model": Refusal, "description": "The body could not be parsed (FastAPI's answer)."},
    401: {"model": Refusal, "description": "No user has this email."},
    402: {"model": Declined, "description": "The card was declined; nothing was charged."},
}


class RideParams(RideBody):
    """What the operation stores and fingerprints: the body and who sent it."""

    user_id: int


# The address of the client whose request runs the phase. It is not part of the params:
# a client that retries from another network sends the same request.
client_ip: ContextVar[str | None] = ContextVar("client_ip", default=None)


# Every statement of a phase names its scope (the user's id, as the API scopes keys): on
# Citus, it then runs on the scope's worker alone.
_INSERT_RIDE = (
    "INSERT INTO rides (scope, idempotency_key_id, origin_lat, origin_lon, target_lat, "
    "target_lon, user_id) VALUES (%(scope)s, %(key_id)s, %(origin_lat)s, %(origin_lon)s, "
    "%(target_lat)s, %(target_lon)s, %(user_id)s) RETURNING id"
)
_INSERT_AUDIT = (
    "INSERT INTO audit_records (scope, action, data, origin_ip, resource_id, "
    "resource_type, user_id) VALUES (%(scope)s, 'ride.created', CAST(%(data)s AS jsonb), "
    "CAST(%(ip)s AS cidr), %(ride_id)s, 'ride', %(user_id)s)"
)
_CUSTOMER = "SELECT customer_id FROM users WHERE id = %s"
# How long the provider remembers an idempotency key, as Stripe does. A ride whose charge
# is resumed later than this is held for an operator (`recoverypoint keys reconcile`):
# charging it again with the same key might charge twice.
PROVIDER_WINDOW = timedelta(hours=24)
_RECORD_CHARGE = "UPDATE rides SET charge_id = %s WHERE id = %s AND scope = %s"


def ride_operation(
    provider: httpx.Client, lock_timeout: timedelta = timedelta(seconds=90)
) -> rp.Operation[RideParams]:
    """``lock_timeout`` must be the same wherever the operation runs (API and completer)."""
    rides = rp.Operation("create_ride", params=RideParams, lock_timeout=lock_timeout)

    @rides.atomic_phase("ride_created")
    def create_ride(tx: rp.AtomicContext, params: RideParams) -> None:
        tx.state["ride_id"] = tx.scalar(_INSERT_RIDE, _ride(tx.key_id, params))
        tx.execute(_INSERT_AUDIT, _audit(params, tx.state["ride_id"]))
        tx.state["customer"] = tx.scalar(_CUSTOMER, (params.user_id,))

    @rides.foreign_step("charge_created", dedupe_window=PROVIDER_WINDOW)
    def charge(step: rp.StepContext, params: RideParams) -> dict[str, Any] | rp.Response:
        try:
            answer = provider.post("/charges", **_charge(step))
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        return _charged(answer)

    @rides.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: RideParams) -> rp.Response:
        tx.execute(_RECORD_CHARGE, _recorded(tx, params))
        return _finished(tx, params)

    return rides


def async_ride_operation(
    provider: httpx.AsyncClient, lock_timeout: timedelta = timedelta(seconds=90)
) -> rp.Operation[RideParams]:
    """:func:`ride_operation` for ``rp.AsyncEngine``: the same phases, ``async def``."""
    rides = rp.Operation("create_ride", params=RideParams, lock_timeout=lock_timeout)

    @rides.atomic_phase("ride_created")
    async def create_ride(tx: rp.AsyncAtomicContext, params: RideParams) -> None:
        tx.state["ride_id"] = await tx.scalar(_INSERT_RIDE, _ride(tx.key_id, params))
        await tx.execute(_INSERT_AUDIT, _audit(params, tx.state["ride_id"]))
        tx.state["customer"] = await tx.scalar(_CUSTOMER, (params.user_id,))

    @rides.foreign_step("charge_created", dedupe_window=PROVIDER_WINDOW)
    async def charge(step: rp.StepContext, params: RideParams) -> dict[str, Any] | rp.Response:
        try:
            answer = await provider.post("/charges", **_charge(step))
        except httpx.TransportError as exc:
            raise _unreachable(exc) from exc
        return _charged(answer)

    @rides.atomic_phase("finished")
    async def finish(tx: rp.AsyncAtomicContext, params: RideParams) -> rp.Response:
        await tx.execute(_RECORD_CHARGE, _recorded(tx, params))
        return _finished(tx, params)

    return rides


def scope_of(user_id: int) -> str:
    """The scope of a user's keys and rows."""
    return str(user_id)


def _ride(key_id: int, params: RideParams) -> dict[str, Any]:
    return {"key_id": key_id, "scope": scope_of(params.user_id), **params.model_dump()}


def _recorded(
    tx: rp.AtomicContext | rp.AsyncAtomicContext, params: RideParams
) -> tuple[str, int, str]:
    return tx.state["charge_id"], tx.state["ride_id"], scope_of(params.user_id)


def _audit(params: RideParams, ride_id: int) -> dict[str, Any]:
    return {
        "scope": scope_of(params.user_id),
        "data": params.model_dump_json(),
        "ip": client_ip.get(),
        "ride_id": ride_id,
        "user_id": params.user_id,
    }


def _charge(step: rp.StepContext) -> dict[str, Any]:
    """The provider call's body and headers, with the key's downstream key. The body holds
    nothing a lossy failover changes: one that loses ``ride_created`` has the ride made
    anew under another id, and a provider that refuses a key reused with other params, as
    Stripe does, would refuse the retry's charge. The ride names its charge instead."""
    return {
        "json": {"amount": AMOUNT, "currency": CURRENCY, "customer": step.state["customer"]},
        "headers": {"Idempotency-Key": step.downstream_key()},
    }


def _unreachable(exc: httpx.TransportError) -> rp.Retryable:
    return rp.Retryable(f"the payment provider is unreachable: {exc!r}")


def _charged(answer: httpx.Response) -> dict[str, Any] | rp.Response:
    """The step's result from the provider's answer."""
    if answer.status_code == 402:
        return rp.Response(402, {"error": "card_declined", "message": "Your card was declined."})
    if answer.status_code in (409, 429) or answer.status_code >= 500:
        raise rp.Retryable(f"the payment provider answered {answer.status_code}")
    answer.raise_for_status()  # any other error is a bug of ours: a 500
    return {"charge_id": answer.json()["id"]}


def _finished(tx: rp.AtomicContext | rp.AsyncAtomicContext, params: RideParams) -> rp.Response:
    """Stage the receipt and answer, once the charge is recorded on the ride."""
    ride_id, charge_id = tx.state["ride_id"], tx.state["charge_id"]
    tx.stage_job(
        "send_ride_receipt",
        {"ride_id": ride_id, "user_id": params.user_id, "amount": AMOUNT, "currency": CURRENCY},
    )
    body = {"ride_id": ride_id, "charge_id": charge_id}
    return rp.Response(201, body, {"Location": f"/rides/{ride_id}"})


def create_app(
    engine: rp.Engine,
    rides: rp.Operation[RideParams],
    *,
    async_engine: rp.AsyncEngine | None = None,
) -> FastAPI:
    """The API around ``rides``, which runs on ``async_engine`` when one is given (then
    its phases are ``async def``: :func:`async_ride_operation`), else on ``engine``."""
    (engine if async_engine is None else async_engine).register(rides)
    idempotency = Idempotency(
        engine, async_engine=async_engine, scope=lambda request: scope_of(request.state.user_id)
    )
    app = FastAPI(title="Rocket Rides")

    def user_id(request: Request, authorization: Annotated[str | None, Header()] = None) -> int:
        if not authorization:
            raise _unauthorized("send Authorization: Bearer <email>")
        scheme, _, email = authorization.partition(" ")
        with engine.db.connect() as conn:
            found = conn.scalar(
                sa.text("SELECT id FROM users WHERE email = :email"), {"email": email.strip()}
            )
        if scheme.lower() != "bearer" or found is None:
            raise _unauthorized("no user has this email")
        request.state.user_id = found
        return int(found)

    @app.post("/rides", status_code=201, responses=_ANSWERS)
    @idempotency.phased()
    # The dependency as a default, not in Annotated: `user_id` is local, and string
    # annotations are resolved in the module's globals. Async: on the event loop when the
    # operation is async, else in a worker thread (run_async hands it to one).
    async def post_ride(request: Request, body: RideBody, user: int = Depends(user_id)) -> Response:
        client_ip.set(request.client.host if request.client else None)
        params = RideParams(user_id=user, **body.model_dump())
        return await idempotency.run_async(rides, request, params)

    return app


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
