"""A fake payment provider over HTTP, idempotent the way Stripe is.

``POST /charges`` with an ``Idempotency-Key`` header and ``{amount, currency, customer}``
(and optionally ``metadata``, string pairs kept with the charge, as Stripe keeps them)
answers ``200 {"id": "ch_…"}``. A key it has seen returns the charge it made for it, never a
second one: charges live in ``provider_charges``, whose ``idempotency_key`` is unique. The
same key with other params is refused (400), as Stripe refuses it. Customer
``cus_declined`` gets ``402``, and nothing is charged.

It is written without recoverypoint on purpose: it stands for a foreign system.

Fault knobs, to watch the API and its clients recover:

- ``fail_rate``: answer 500 before charging;
- ``fail_after_charge_rate``: store a new charge, then fail to answer, alternately with a
  500 and by dropping the connection before the body. Only the request that created the
  charge fails: a retry with the same key gets the charge, as from Stripe;
- ``latency_ms``: wait before answering;
- ``seed``: for a repeatable sequence of faults.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
from dataclasses import dataclass, field
from itertools import cycle

import anyio
import sqlalchemy as sa
from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("rocket_rides.provider")

DECLINED_CUSTOMER = "cus_declined"


class ChargeRequest(BaseModel):
    amount: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    customer: str = Field(min_length=1)
    metadata: dict[str, str] = Field(default_factory=dict)


@dataclass
class Faults:
    fail_rate: float = 0.0
    fail_after_charge_rate: float = 0.0
    latency_ms: int = 0
    seed: int | None = None
    _after_charge: cycle[str] = field(default_factory=lambda: cycle(("error", "drop")))
    _random: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def before_charge(self) -> bool:
        return self._random.random() < self.fail_rate

    def after_charge(self) -> str | None:
        """``"error"``, ``"drop"`` or ``None``: how to fail after creating a charge."""
        failing = self._random.random() < self.fail_after_charge_rate
        return next(self._after_charge) if failing else None


class DroppedConnection(Response):
    """Start an answer that promises a body, then end without it: the server closes the
    connection, and the client sees it drop before the answer is complete."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"64")]}
        )


def error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status)


def create_app(db: sa.Engine, faults: Faults) -> Starlette:
    db = db.execution_options(isolation_level="AUTOCOMMIT")

    async def charges(request: Request) -> Response:
        if faults.latency_ms:
            await anyio.sleep(faults.latency_ms / 1000)
        key = request.headers.get("Idempotency-Key")
        if not key:
            return error(400, "invalid_request_error", "send an Idempotency-Key header")
        try:
            charge = ChargeRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return error(400, "invalid_request_error", str(exc))
        if faults.before_charge():
            logger.warning("fault: failing before charging (key %s)", key)
            return error(500, "api_error", "fault injected before the charge")
        if charge.customer == DECLINED_CUSTOMER:
            return error(402, "card_error", "Your card was declined.")
        charge_id, created = await run_in_threadpool(store_charge, db, key, charge)
        if charge_id is None:
            return error(400, "idempotency_error", "this key was used with other params")
        fault = faults.after_charge() if created else None
        if fault is not None:
            logger.warning("fault: charged %s, then %s (key %s)", charge_id, fault, key)
            if fault == "drop":
                return DroppedConnection()
            return error(500, "api_error", "fault injected after the charge")
        return JSONResponse({"id": charge_id})

    return Starlette(routes=[Route("/charges", charges, methods=["POST"])])


def store_charge(db: sa.Engine, key: str, charge: ChargeRequest) -> tuple[str | None, bool]:
    """The charge for ``key``, and whether this call created it; ``None`` when the key was
    used with other params."""
    with db.connect() as conn:
        created = conn.scalar(
            sa.text(
                "INSERT INTO provider_charges "
                "(id, idempotency_key, amount, currency, customer, metadata) "
                "VALUES (:id, :key, :amount, :currency, :customer, CAST(:metadata AS jsonb)) "
                "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id"
            ),
            {
                "id": f"ch_{secrets.token_hex(12)}",
                "key": key,
                **charge.model_dump(exclude={"metadata"}),
                "metadata": json.dumps(charge.metadata),
            },
        )
        if created is not None:
            return created, True
        # A separate statement: its snapshot sees the charge a concurrent request committed.
        row = conn.execute(
            sa.text(
                "SELECT id, amount, currency, customer, metadata FROM provider_charges "
                "WHERE idempotency_key = :key"
            ),
            {"key": key},
        ).one()
    same = (row.amount, row.currency, row.customer, row.metadata) == (
        charge.amount,
        charge.currency,
        charge.customer,
        charge.metadata,
    )
    return (row.id if same else None), False
