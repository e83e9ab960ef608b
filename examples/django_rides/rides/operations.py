"""Rocket Rides' booking as a recoverypoint operation whose phases use the Django ORM.

create the ride (and its audit record) → charge the card at the provider → record the
charge and stage the receipt, 201. Each atomic phase's ORM writes commit with its recovery
point; the charge runs outside any transaction, under a downstream key, so a retry after a
crash anywhere charges once.
"""

from __future__ import annotations

from typing import Any

import recoverypoint as rp
from recoverypoint.integrations.django import Idempotency, django_engine

from .models import AuditRecord, Ride


class PaymentProvider:
    """Stands in for Stripe: a repeated idempotency key returns the first charge."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}

    def charge(self, idempotency_key: str, amount: int) -> str:
        return self.charges.setdefault(idempotency_key, f"ch_{len(self.charges) + 1}")


provider = PaymentProvider()
engine = django_engine()  # on Django's own connection: the ORM writes in each phase
idempotency = Idempotency(engine)  # keys belong to the authenticated user

rides: rp.Operation[Any] = rp.Operation("django_create_ride")


@rides.atomic_phase("ride_created")
def create_ride(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
    ride = Ride.objects.create(
        user_id=params["user_id"],
        origin=params["origin"],
        target=params["target"],
        key_id=tx.key_id,
    )
    AuditRecord.objects.create(user_id=params["user_id"], action="ride.created", key_id=tx.key_id)
    tx.state["ride_id"] = ride.pk


@rides.foreign_step("charged")
def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"charge_id": provider.charge(step.downstream_key(), 2000)}


@rides.atomic_phase("finished")
def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
    Ride.objects.filter(pk=tx.state["ride_id"]).update(charge_id=tx.state["charge_id"])
    tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
    body = {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
    return rp.Response(201, body, {"Location": f"/rides/{tx.state['ride_id']}"})


engine.register(rides)
