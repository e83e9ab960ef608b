"""A small ride-booking operation shared by the engine tests, with a real foreign system.

The "payment provider" is a table in its own autocommit connection, keyed by the downstream
key: a charge with a key it has seen returns the first charge, as Stripe does. Faults are
raised at named boundaries so a test can stop a request anywhere.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

import recoverypoint as rp

SCHEMA = """
CREATE TABLE IF NOT EXISTS rides (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_id bigint NOT NULL UNIQUE,
    scope text NOT NULL,
    charge_id text
);
CREATE TABLE IF NOT EXISTS audit_records (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope text NOT NULL,
    action text NOT NULL,
    key_id bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS provider_charges (
    id text PRIMARY KEY DEFAULT 'ch_' || md5(random()::text),
    downstream_key text NOT NULL UNIQUE,
    scope text NOT NULL,
    amount integer NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name text PRIMARY KEY,
    n integer NOT NULL
);
"""


class Boom(Exception):
    """A fault injected by a test."""


class Provider:
    """A foreign payment system: same downstream key, same charge."""

    def __init__(self, db: sa.Engine) -> None:
        self.db = db.execution_options(isolation_level="AUTOCOMMIT")
        self.keys_seen: list[str] = []

    def charge(self, downstream_key: str, scope: str, amount: int) -> str:
        self.keys_seen.append(downstream_key)
        with self.db.connect() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO provider_charges (downstream_key, scope, amount) "
                    "VALUES (:k, :s, :a) ON CONFLICT (downstream_key) DO NOTHING"
                ),
                {"k": downstream_key, "s": scope, "a": amount},
            )
            charge_id: str = conn.execute(
                sa.text("SELECT id FROM provider_charges WHERE downstream_key = :k"),
                {"k": downstream_key},
            ).scalar_one()
        return charge_id


class Faults:
    """Named fault points; each raises :class:`Boom` once when armed."""

    def __init__(self) -> None:
        self.armed: set[str] = set()
        self.hooks: dict[str, Callable[[], None]] = {}
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hit(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1
            fire = name in self.armed
            self.armed.discard(name)
        hook = self.hooks.get(name)
        if hook is not None:
            hook()
        if fire:
            raise Boom(name)


def ride_operation(
    name: str, provider: Provider, faults: Faults, **options: Any
) -> rp.Operation[Any]:
    """create ride (+audit) → charge at the provider → record charge, stage receipt, 201."""
    op: rp.Operation[Any] = rp.Operation(name, **options)

    @op.atomic_phase("ride_created")
    def create_ride(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        faults.hit("ride_created:start")
        scope = params["scope"]
        tx.state["ride_id"] = tx.connection.execute(
            sa.text("INSERT INTO rides (key_id, scope) VALUES (:k, :s) RETURNING id"),
            {"k": tx.key_id, "s": scope},
        ).scalar_one()
        tx.connection.execute(
            sa.text(
                "INSERT INTO audit_records (scope, action, key_id) VALUES (:s, 'ride.created', :k)"
            ),
            {"k": tx.key_id, "s": scope},
        )
        faults.hit("ride_created:before_commit")

    @op.foreign_step("charge_created")
    def charge(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any] | rp.Response:
        faults.hit("charge_created:before_call")
        if params.get("customer") == "cus_declined":
            return rp.Response(402, {"error": "card_declined"})
        charge_id = provider.charge(step.downstream_key(), params["scope"], 2000)
        faults.hit("charge_created:after_call")
        return {"charge_id": charge_id}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        faults.hit("finished:start")
        tx.connection.execute(
            sa.text("UPDATE rides SET charge_id = :c WHERE id = :i"),
            {"c": tx.state["charge_id"], "i": tx.state["ride_id"]},
        )
        tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
        faults.hit("finished:before_commit")
        body = {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
        return rp.Response(201, body, {"Location": f"/rides/{tx.state['ride_id']}"})

    return op


def count(db: sa.Engine, sql: str, **params: Any) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(sql), params).scalar_one())
