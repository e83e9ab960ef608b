"""Rocket Rides' ``create_ride`` for :func:`recoverypoint.explore.explore`, on the command
line::

    recoverypoint explore recoverypoint.demo.rocket_rides.explore:subject

The provider is the example's own (:func:`.provider.store_charge`: the same key, the same
charge), answering in-process through ``httpx.MockTransport`` rather than over a socket:
a schedule takes milliseconds, and a forked attempt needs no server thread.
"""

from __future__ import annotations

import httpx
import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.explore import Subject
from recoverypoint.jobs import InProcessBackend, Job

from .api import RideParams, ride_operation, scope_of
from .provider import DECLINED_CUSTOMER, ChargeRequest, store_charge
from .receipts import RECEIPT_JOB, send_ride_receipt
from .schema import TABLES, migrate

# Emptied between schedules; users stay.
EMPTIED = tuple(table for table in TABLES if table != "users")


def one_ride_charged_once(conn: sa.Connection) -> None:
    """One ride, one charge at the provider and it is the ride's, one receipt sent."""
    rides = conn.execute(sa.text("SELECT id, charge_id FROM rides")).all()
    charges = conn.execute(sa.text("SELECT id FROM provider_charges")).all()
    assert len(rides) == 1, f"{len(rides)} rides for one request"
    assert len(charges) == 1, f"{len(charges)} charges at the provider for one ride"
    assert rides[0].charge_id == charges[0].id, "the ride does not hold the provider's charge"
    receipts = conn.scalar(sa.text("SELECT count(*) FROM receipts"))
    assert receipts == 1, f"{receipts} receipts sent for one ride"
    audits = conn.scalar(sa.text("SELECT count(*) FROM audit_records"))
    assert audits == 1, f"{audits} audit records for one ride"


def subject(database_url: str) -> Subject:
    """A ride booked by alice, on ``database_url`` (the example's tables are made here)."""
    db = create_engine(database_url)
    migrate(db)
    payments = sa.create_engine(db.url, isolation_level="AUTOCOMMIT")

    def charges(request: httpx.Request) -> httpx.Response:
        charge = ChargeRequest.model_validate_json(request.content)
        if charge.customer == DECLINED_CUSTOMER:
            return httpx.Response(402, json={"error": {"type": "card_error"}})
        charge_id, _ = store_charge(payments, request.headers["Idempotency-Key"], charge)
        if charge_id is None:
            return httpx.Response(400, json={"error": {"type": "idempotency_error"}})
        return httpx.Response(200, json={"id": charge_id})

    provider = httpx.Client(base_url="http://provider", transport=httpx.MockTransport(charges))
    receipts = InProcessBackend()
    engine = rp.Engine(db, jobs=receipts)
    rides = ride_operation(provider)
    engine.register(rides)

    @receipts.handler(RECEIPT_JOB)
    def receipt(job: Job) -> None:
        send_ride_receipt(db, job)

    with db.connect() as conn:
        alice = conn.scalar(sa.text("SELECT id FROM users WHERE email = 'alice@example.com'"))
    params = RideParams(user_id=alice, origin_lat=1, origin_lon=2, target_lat=3, target_lon=4)
    return Subject(
        engine,
        rides,
        params,
        scope=scope_of(alice),
        check=one_ride_charged_once,
        tables=EMPTIED,
        dispose=[payments],
    )
