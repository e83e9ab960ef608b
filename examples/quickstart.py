"""A ride booking that survives a crash between the charge and its record.

Run from the repository root::

    python -m examples.quickstart                      # embedded PostgreSQL
    python -m examples.quickstart --database-url URL   # or your own

It books one ride with an idempotency key, makes the first attempt fail right after the
payment provider charged the card, retries with the same key (the ride is not created
again, the provider sees the same downstream key and returns the same charge), then sends
the request once more and gets the stored response back.
"""

from __future__ import annotations

import argparse
import os
import uuid
from contextlib import ExitStack

import sqlalchemy as sa
from pydantic import BaseModel

import recoverypoint as rp
from recoverypoint.embedded import embedded_database
from recoverypoint.migrate import upgrade


class RideParams(BaseModel):
    origin: str
    target: str


class PaymentProvider:
    """Stands in for Stripe: a repeated idempotency key returns the first charge."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}
        self.fail_after_next_charge = False

    def charge(self, amount: int, idempotency_key: str) -> str:
        charge_id = self.charges.setdefault(idempotency_key, f"ch_{len(self.charges) + 1}")
        if self.fail_after_next_charge:
            self.fail_after_next_charge = False
            raise ConnectionError("connection dropped after the provider charged the card")
        return charge_id


payments = PaymentProvider()
rides = rp.Operation("create_ride", params=RideParams)


@rides.atomic_phase("ride_created")
def create_ride(tx: rp.AtomicContext, params: RideParams) -> None:
    tx.state["ride_id"] = tx.scalar(
        "INSERT INTO rides (origin, target) VALUES (%(origin)s, %(target)s) RETURNING id",
        params.model_dump(),
    )


@rides.foreign_step("charge_created")
def charge(step: rp.StepContext, params: RideParams) -> dict[str, str]:
    return {"charge_id": payments.charge(2000, idempotency_key=step.downstream_key())}


@rides.atomic_phase("finished")
def finish(tx: rp.AtomicContext, params: RideParams) -> rp.Response:
    tx.execute(
        "UPDATE rides SET charge_id = %s WHERE id = %s",
        (tx.state["charge_id"], tx.state["ride_id"]),
    )
    tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
    return rp.Response(201, {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("RECOVERYPOINT_DATABASE_URL"))
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.database_url or stack.enter_context(embedded_database())
        upgrade(url)
        engine = rp.Engine(url)
        stack.callback(engine.dispose)
        with engine.db.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE TABLE IF NOT EXISTS rides (id bigserial PRIMARY KEY, "
                    "origin text NOT NULL, target text NOT NULL, charge_id text)"
                )
            )
        engine.register(rides)
        run(engine)


def run(engine: rp.Engine) -> None:
    key = str(uuid.uuid4())
    body = {"origin": "Ferry Building", "target": "Mission Dolores"}
    request = rp.Request("POST", "/rides")

    payments.fail_after_next_charge = True
    try:
        engine.run(rides, key=key, params=body, scope="user-1", request=request)
    except ConnectionError as exc:
        print(f"1st attempt failed: {exc}")

    retry = engine.run(rides, key=key, params=body, scope="user-1", request=request)
    print(f"2nd attempt (same key): {retry.status} {retry.body} replayed={retry.replayed}")
    replay = engine.run(rides, key=key, params=body, scope="user-1", request=request)
    print(f"3rd attempt (same key): {replay.status} {replay.body} replayed={replay.replayed}")

    with engine.db.connect() as conn:
        ride_count = conn.execute(sa.text("SELECT count(*) FROM rides")).scalar_one()
        jobs = conn.execute(sa.text("SELECT count(*) FROM staged_jobs")).scalar_one()
    print(
        f"rides: {ride_count}, charges at the provider: {len(payments.charges)}, "
        f"receipt jobs staged: {jobs}"
    )
    assert ride_count == 1 and len(payments.charges) == 1 and jobs == 1, "not exactly once!"
    print("exactly once: one ride, one charge, one receipt")


if __name__ == "__main__":
    main()
