"""The example's tables, after the reference app's, and its two users.

Departures from the reference: the provider is not Stripe, so ``users.stripe_customer_id``
and ``rides.stripe_charge_id`` are ``customer_id`` and ``charge_id``; ``provider_charges``
is the fake provider's own table. ``audit_records.origin_ip`` is NULL for a ride the
completer created, since no client was there. ``receipts`` and ``receipt_deliveries`` are
the receipt consumer's (:mod:`.workers`): each delivery of a receipt job is logged, and
each receipt is sent once.
"""

from __future__ import annotations

import sqlalchemy as sa

from recoverypoint.distribute import distribute, has_citus, make_reference
from recoverypoint.migrate import upgrade

# On a Citus coordinator: the tables the phases write, distributed by scope and co-located
# with the keys; the others, which no phase writes (the users a phase reads, the provider's
# and the receipt consumer's), reference tables, copied to every node.
CO_LOCATED = ("rides", "audit_records")
REFERENCE = ("users", "provider_charges", "receipt_deliveries", "receipts")
TABLES = (*CO_LOCATED, *REFERENCE)
"""Every table of the example's, those that refer to ``users`` before it."""

USERS = {"alice@example.com": "cus_alice", "declined@example.com": "cus_declined"}

DDL = """
CREATE TABLE IF NOT EXISTS users (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    email text NOT NULL UNIQUE,
    customer_id text NOT NULL UNIQUE
);
-- rides and audit_records carry the scope of the key that wrote them (the user's id, as
-- text), in every key and unique constraint: on Citus they are distributed by it,
-- co-located with idempotency_keys, so that a phase writes on its scope's worker alone.
CREATE TABLE IF NOT EXISTS rides (
    id bigint GENERATED ALWAYS AS IDENTITY,
    scope text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The key that created the ride. No foreign key: idempotency_keys is keyed by
    -- (id, scope), so that it can be distributed by scope; the reaper deletes old keys
    -- and the rides stay.
    idempotency_key_id bigint,
    origin_lat numeric(13, 10) NOT NULL,
    origin_lon numeric(13, 10) NOT NULL,
    target_lat numeric(13, 10) NOT NULL,
    target_lon numeric(13, 10) NOT NULL,
    charge_id text,
    user_id bigint NOT NULL,  -- refers to users (FOREIGN_KEYS)
    PRIMARY KEY (id, scope),
    UNIQUE (idempotency_key_id, scope),
    UNIQUE (charge_id, scope)
);
CREATE TABLE IF NOT EXISTS audit_records (
    id bigint GENERATED ALWAYS AS IDENTITY,
    scope text NOT NULL,
    action text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    data jsonb NOT NULL,
    origin_ip cidr,
    resource_id bigint NOT NULL,
    resource_type text NOT NULL,
    user_id bigint NOT NULL,  -- refers to users (FOREIGN_KEYS)
    PRIMARY KEY (id, scope)
);
CREATE TABLE IF NOT EXISTS provider_charges (
    id text PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    amount integer NOT NULL,
    currency text NOT NULL,
    customer text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- Like Stripe's: what the caller attached to the charge (Rocket Rides attaches nothing).
ALTER TABLE provider_charges ADD COLUMN IF NOT EXISTS metadata jsonb NOT NULL DEFAULT '{}';
-- No unique job_key in either table: a receipt sent twice must be countable, not an error.
CREATE TABLE IF NOT EXISTS receipt_deliveries (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_key text NOT NULL,
    enqueuer_pid integer NOT NULL,
    delivered_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS receipts (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_key text NOT NULL,
    ride_id bigint NOT NULL,
    user_id bigint NOT NULL REFERENCES users (id),
    amount integer NOT NULL,
    currency text NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT now()
);
"""

# rides' and audit_records' references to users, added once the tables are placed: on
# Citus, a table that refers to a reference table before it is distributed is made a local
# table of Citus's, which cannot then be distributed (its identity column); distributed,
# it may refer to one. Named as PostgreSQL names them, so that a database migrated when
# the DDL declared them keeps its own.
FOREIGN_KEYS = {
    (table, f"{table}_user_id_fkey"): f"ALTER TABLE {table} ADD CONSTRAINT {table}_user_id_fkey "
    "FOREIGN KEY (user_id) REFERENCES users (id)"
    for table in CO_LOCATED
}
_HAS_CONSTRAINT = sa.text(
    "SELECT EXISTS (SELECT FROM pg_constraint "
    "WHERE conrelid = CAST(:t AS regclass) AND conname = :name)"
)
_ONE_MIGRATOR = sa.text("SELECT pg_advisory_xact_lock(hashtext('rocket_rides schema'))")

_SEED = sa.text(
    "INSERT INTO users (email, customer_id) VALUES (:email, :customer) "
    "ON CONFLICT (email) DO NOTHING"
)


def migrate(db: sa.Engine) -> None:
    """recoverypoint's tables, then the example's (``rides`` refers to ``idempotency_keys``);
    on a Citus coordinator, all of them placed as ``recoverypoint migrate --citus`` does,
    with the example's by :data:`CO_LOCATED` and :data:`REFERENCE`."""
    upgrade(db)
    with db.begin() as conn:
        # One migrator at a time: CREATE TABLE IF NOT EXISTS is not safe against itself.
        conn.execute(_ONE_MIGRATOR)
        conn.exec_driver_sql(DDL)
        conn.execute(_SEED, [{"email": e, "customer": c} for e, c in USERS.items()])
    if has_citus(db):
        make_reference(db, REFERENCE)
        distribute(db, colocate=CO_LOCATED)
    with db.begin() as conn:
        conn.execute(_ONE_MIGRATOR)
        for (table, name), statement in FOREIGN_KEYS.items():
            if not conn.execute(_HAS_CONSTRAINT, {"t": table, "name": name}).scalar_one():
                conn.exec_driver_sql(statement)


def require(db: sa.Engine, *tables: str) -> None:
    """Exit with a message a person can act on when ``migrate`` has not been run."""
    with db.connect() as conn:
        missing = [
            t for t in tables if conn.scalar(sa.text("SELECT to_regclass(:t)"), {"t": t}) is None
        ]
    if missing:
        raise SystemExit(
            f"missing tables {', '.join(missing)}: run "
            "python -m recoverypoint.demo.rocket_rides migrate --database-url URL first"
        )
