"""The Rocket Rides flow three ways, doing the same SQL: claim the key, create a ride and its
audit record, "charge" (an in-process stand-in for the foreign call), record the charge,
stage a receipt job and finish with a stored response.

Each flow is a class with ``run(key)``: one request (a fresh key, or a finished one to
replay it). Beside them, the work alone (:class:`WorkOnly`): the same statements without
the key's, in two transactions as recoverypoint's two phases (the reference takes three for
them), the floor under every idempotent way of doing it. Also here: the two Redis
lookups the replay is measured beside.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.errors import SerializationFailure

import recoverypoint as rp

SCHEMA = """
CREATE TABLE IF NOT EXISTS bench_rides (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_key text NOT NULL,
    origin_lat numeric(13, 10) NOT NULL,
    origin_lon numeric(13, 10) NOT NULL,
    charge_id text
);
CREATE TABLE IF NOT EXISTS bench_audit_records (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action text NOT NULL,
    data jsonb NOT NULL,
    resource_id bigint NOT NULL
);
-- rocket-rides-atomic's own key table, for the hand-written reference.
CREATE TABLE IF NOT EXISTS rr_idempotency_keys (
    id bigserial PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    idempotency_key text NOT NULL,
    last_run_at timestamptz NOT NULL DEFAULT now(),
    locked_at timestamptz DEFAULT now(),
    request_method text NOT NULL,
    request_params jsonb NOT NULL,
    request_path text NOT NULL,
    response_code int,
    response_body jsonb,
    recovery_point text NOT NULL,
    user_id bigint NOT NULL,
    UNIQUE (user_id, idempotency_key)
);
CREATE TABLE IF NOT EXISTS rr_staged_jobs (
    id bigserial PRIMARY KEY,
    job_name text NOT NULL,
    job_args jsonb NOT NULL
);
"""

PARAMS = {"origin_lat": 37.7749, "origin_lon": -122.4194}


def charge(downstream_key: str) -> str:
    """The foreign call's stand-in: deterministic per downstream key, no I/O."""
    return "ch_" + hashlib.sha256(downstream_key.encode()).hexdigest()[:24]


class Reference:
    """rocket-rides-atomic by hand: four SERIALIZABLE transactions on one psycopg connection
    per client, each retried on 40001."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=False)
        self.conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE

    def _tx(self, work: Any) -> Any:
        while True:
            try:
                with self.conn.transaction():
                    return work(self.conn.cursor())
            except SerializationFailure:
                continue

    def run(self, key: str) -> dict[str, Any]:
        params = json.dumps(PARAMS)

        def claim(cur: psycopg.Cursor[tuple[Any, ...]]) -> tuple[Any, ...]:
            cur.execute(
                "SELECT id, recovery_point, locked_at, response_code, response_body "
                "FROM rr_idempotency_keys WHERE user_id = %s AND idempotency_key = %s",
                (1, key),
            )
            row = cur.fetchone()
            if row is not None:
                cur.execute(
                    "UPDATE rr_idempotency_keys SET last_run_at = now(), locked_at = now() "
                    "WHERE id = %s",
                    (row[0],),
                )
                return row
            cur.execute(
                "INSERT INTO rr_idempotency_keys (idempotency_key, locked_at, recovery_point, "
                "request_method, request_params, request_path, user_id) "
                "VALUES (%s, now(), 'started', 'POST', %s, '/rides', 1) "
                "RETURNING id, recovery_point, locked_at, response_code, response_body",
                (key, params),
            )
            return cur.fetchone()  # type: ignore[return-value]

        key_id, point, _, code, body = self._tx(claim)
        if point == "finished":
            return {"status": code, "body": body}

        def create_ride(cur: psycopg.Cursor[Any]) -> int:
            ride_id = insert_ride(cur, key, params)
            cur.execute(
                "UPDATE rr_idempotency_keys SET recovery_point = 'ride_created' WHERE id = %s",
                (key_id,),
            )
            return ride_id

        ride_id = self._tx(create_ride)
        charge_id = charge(f"rocket-rides-atomic-{key_id}")

        def record_charge(cur: psycopg.Cursor[Any]) -> None:
            set_charge(cur, ride_id, charge_id)
            cur.execute(
                "UPDATE rr_idempotency_keys SET recovery_point = 'charge_created' WHERE id = %s",
                (key_id,),
            )

        self._tx(record_charge)
        response = json.dumps({"ride_id": ride_id, "charge_id": charge_id})

        def finish(cur: psycopg.Cursor[Any]) -> None:
            stage_receipt(cur, ride_id)
            cur.execute(
                "UPDATE rr_idempotency_keys SET locked_at = NULL, recovery_point = 'finished', "
                "response_code = 201, response_body = %s WHERE id = %s",
                (response, key_id),
            )

        self._tx(finish)
        return {"status": 201, "body": response}

    def close(self) -> None:
        self.conn.close()


class WorkOnly(Reference):
    """The flow's own work and nothing else, by hand: the ride and its audit record in one
    transaction, the charge, then the charge recorded and the receipt staged in another. No
    key, no recovery point, no stored response: not safe to retry, and the least any
    idempotent version of this flow can cost."""

    def run(self, key: str) -> dict[str, Any]:
        ride_id = self._tx(lambda cur: insert_ride(cur, key, json.dumps(PARAMS)))
        charge_id = charge(f"work-only-{key}")

        def finish(cur: psycopg.Cursor[Any]) -> None:
            set_charge(cur, ride_id, charge_id)
            stage_receipt(cur, ride_id)

        self._tx(finish)
        return {"status": 201, "body": json.dumps({"ride_id": ride_id, "charge_id": charge_id})}


def insert_ride(cur: psycopg.Cursor[Any], key: str, params: str) -> int:
    """The ride and its audit record; the ride's id."""
    cur.execute(
        "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) "
        "VALUES (%s, %s, %s) RETURNING id",
        (key, PARAMS["origin_lat"], PARAMS["origin_lon"]),
    )
    ride_id: int = cur.fetchone()[0]  # type: ignore[index]
    cur.execute(
        "INSERT INTO bench_audit_records (action, data, resource_id) "
        "VALUES ('ride.created', %s, %s)",
        (params, ride_id),
    )
    return ride_id


def set_charge(cur: psycopg.Cursor[Any], ride_id: int, charge_id: str) -> None:
    cur.execute("UPDATE bench_rides SET charge_id = %s WHERE id = %s", (charge_id, ride_id))


def stage_receipt(cur: psycopg.Cursor[Any], ride_id: int) -> None:
    cur.execute(
        "INSERT INTO rr_staged_jobs (job_name, job_args) VALUES ('send_ride_receipt', %s)",
        (json.dumps({"ride_id": ride_id}),),
    )


class PhaseAPI:
    """Which statement API the recoverypoint phases used, as seen at run time."""

    seen: set[str] = set()  # noqa: RUF012 (one set for the process, on purpose)


def ride_operation(name: str = "bench_create_ride", *, fast: bool = True) -> rp.Operation[Any]:
    """The flow as an Operation. ``fast``: the phases send their SQL with ``tx.execute`` (the
    phase's psycopg connection, ``%(name)s`` parameters) when the AtomicContext has it;
    otherwise, and always when not ``fast``, with ``tx.connection.execute(sa.text(...))``.
    The statements are the same text either way, and the same as the other systems'."""
    op: rp.Operation[Any] = rp.Operation(name)

    def execute(tx: rp.AtomicContext, psycopg_sql: str, sa_sql: str, args: dict[str, Any]) -> Any:
        direct = getattr(tx, "execute", None) if fast else None
        if direct is not None:
            PhaseAPI.seen.add("tx.execute")
            return direct(psycopg_sql, args)
        PhaseAPI.seen.add("tx.connection")
        return tx.connection.execute(sa.text(sa_sql), args)

    @op.atomic_phase("ride_created")
    def create_ride(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        ride_id = execute(
            tx,
            "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) "
            "VALUES (%(k)s, %(lat)s, %(lon)s) RETURNING id",
            "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) "
            "VALUES (:k, :lat, :lon) RETURNING id",
            {"k": str(tx.key_id), "lat": params["origin_lat"], "lon": params["origin_lon"]},
        ).fetchone()[0]
        execute(
            tx,
            "INSERT INTO bench_audit_records (action, data, resource_id) "
            "VALUES ('ride.created', CAST(%(d)s AS jsonb), %(r)s)",
            "INSERT INTO bench_audit_records (action, data, resource_id) "
            "VALUES ('ride.created', CAST(:d AS jsonb), :r)",
            {"d": json.dumps(params), "r": ride_id},
        )
        tx.state["ride_id"] = ride_id

    @op.foreign_step("charge_created")
    def charge_step(step: rp.StepContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"charge_id": charge(step.downstream_key())}

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        execute(
            tx,
            "UPDATE bench_rides SET charge_id = %(c)s WHERE id = %(i)s",
            "UPDATE bench_rides SET charge_id = :c WHERE id = :i",
            {"c": tx.state["charge_id"], "i": tx.state["ride_id"]},
        )
        tx.stage_job("send_ride_receipt", {"ride_id": tx.state["ride_id"]})
        return rp.Response(
            201, {"ride_id": tx.state["ride_id"], "charge_id": tx.state["charge_id"]}
        )

    return op


class RecoveryPointFlow:
    """The same flow declared as an Operation; one Engine shared by every client."""

    scope = "1"

    def __init__(self, engine: rp.Engine, op: rp.Operation[Any]) -> None:
        self.engine, self.op = engine, op

    def run(self, key: str) -> rp.Outcome:
        return self.engine.run(
            self.op, key=key, params=PARAMS, scope=self.scope, request=rp.Request("POST", "/rides")
        )

    def close(self) -> None:
        pass


class DBOSFlow:
    """The same flow as a DBOS workflow whose id is the idempotency key: one step per phase,
    each step doing the same SQL in its own SERIALIZABLE transaction.

    Making one launches DBOS (its background threads start); ``close()`` destroys it, so
    that it runs only while measured. Both pools (the application's and DBOS's system
    database's) are given ``pool_size`` connections."""

    def __init__(self, url: str, system_url: str, pool_size: int = 40) -> None:
        from dbos import DBOS, SetWorkflowID

        self._set_id = SetWorkflowID
        self.db = sa.create_engine(
            url, isolation_level="SERIALIZABLE", pool_size=pool_size, max_overflow=4
        )
        db = self.db

        def serializable(work: Any) -> Any:
            while True:
                try:
                    with db.begin() as conn:
                        return work(conn)
                except sa.exc.DBAPIError as exc:
                    if getattr(exc.orig, "sqlstate", None) != "40001":
                        raise

        @DBOS.step()
        def create_ride(key: str) -> int:
            def work(conn: sa.Connection) -> int:
                ride_id: int = conn.execute(
                    sa.text(
                        "INSERT INTO bench_rides (request_key, origin_lat, origin_lon) "
                        "VALUES (:k, :lat, :lon) RETURNING id"
                    ),
                    {"k": key, "lat": PARAMS["origin_lat"], "lon": PARAMS["origin_lon"]},
                ).scalar_one()
                conn.execute(
                    sa.text(
                        "INSERT INTO bench_audit_records (action, data, resource_id) "
                        "VALUES ('ride.created', CAST(:d AS jsonb), :r)"
                    ),
                    {"d": json.dumps(PARAMS), "r": ride_id},
                )
                return ride_id

            return serializable(work)  # type: ignore[no-any-return]

        @DBOS.step()
        def charge_step(key: str) -> str:
            return charge(f"dbos-{key}")

        @DBOS.step()
        def finish(key: str, ride_id: int, charge_id: str) -> dict[str, Any]:
            def work(conn: sa.Connection) -> None:
                conn.execute(
                    sa.text("UPDATE bench_rides SET charge_id = :c WHERE id = :i"),
                    {"c": charge_id, "i": ride_id},
                )
                conn.execute(
                    sa.text(
                        "INSERT INTO rr_staged_jobs (job_name, job_args) "
                        "VALUES ('send_ride_receipt', CAST(:a AS jsonb))"
                    ),
                    {"a": json.dumps({"ride_id": ride_id})},
                )

            serializable(work)
            return {"status": 201, "body": {"ride_id": ride_id, "charge_id": charge_id}}

        @DBOS.workflow()
        def create_ride_workflow(key: str) -> dict[str, Any]:
            ride_id = create_ride(key)
            charge_id = charge_step(key)
            answer: dict[str, Any] = finish(key, ride_id, charge_id)
            return answer

        self.workflow = create_ride_workflow
        DBOS(
            config={
                "name": "rpbench",
                "system_database_url": system_url,
                "log_level": "WARNING",
                "sys_db_pool_size": pool_size,
            }
        )
        DBOS.launch()

    def system_engine(self) -> sa.Engine | None:
        """DBOS's own pool for its system database (an internal of DBOS 3.4; ``None`` if it
        moved), to open its connections before a timed window."""
        from dbos import _dbos

        try:
            engine = _dbos._get_dbos_instance()._sys_db.engine
        except Exception:
            return None
        return engine if isinstance(engine, sa.Engine) else None

    def run(self, key: str) -> dict[str, Any]:
        with self._set_id(key):
            answer: dict[str, Any] = self.workflow(key)
        return answer

    def close(self) -> None:
        from dbos import DBOS

        DBOS.destroy(destroy_registry=True)
        self.db.dispose()


class PreparedSelect:
    """The floor of a replay on PostgreSQL: one prepared ``SELECT`` of a finished key's
    stored answer by its unique key, on a connection held open, in autocommit. What a
    replay cannot do with less: one round trip, one index probe, the row decoded."""

    STATEMENT = (
        "SELECT response_status, response_headers, response_body FROM idempotency_keys"
        " WHERE idempotency_key = %s AND scope = %s AND operation = %s"
    )

    def __init__(self, url: str, scope: str, operation: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.scope, self.operation = scope, operation

    def run(self, key: str) -> Any:
        row = self.conn.execute(
            self.STATEMENT, (key, self.scope, self.operation), prepare=True
        ).fetchone()
        if row is None or row[0] is None:
            raise RuntimeError("no stored answer to read")
        return row

    def close(self) -> None:
        self.conn.close()


class RedisGet:
    """The floor of a cache lookup: one Redis GET of the stored response."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client, self.prefix = client, prefix

    def store(self, key: str, response: dict[str, Any]) -> None:
        self.client.set(self.prefix + key, json.dumps(response), ex=3600)

    def run(self, key: str) -> Any:
        return json.loads(self.client.get(self.prefix + key))


class PowertoolsStyle:
    """A replay as AWS Lambda Powertools' Redis persistence layer does one: the key is a
    hash of the payload; ``SET key record NX EX`` fails because the record exists, so
    ``GET`` it, decode it, check it is COMPLETED, unexpired and for the same payload, and
    return the stored response (two round trips)."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client, self.prefix = client, prefix

    def _key(self, key: str, payload: dict[str, Any]) -> tuple[str, str]:
        payload_hash = hashlib.md5(
            json.dumps(payload, sort_keys=True).encode(), usedforsecurity=False
        ).hexdigest()
        return f"{self.prefix}bench_create_ride#{key}", payload_hash

    def store(self, key: str, response: dict[str, Any]) -> None:
        name, payload_hash = self._key(key, PARAMS)
        record = {
            "status": "COMPLETED",
            "expiration": int(time.time()) + 3600,
            "data": json.dumps(response),
            "validation": payload_hash,
        }
        self.client.set(name, json.dumps(record), ex=3600)

    def run(self, key: str) -> Any:
        name, payload_hash = self._key(key, PARAMS)
        in_progress = {
            "status": "INPROGRESS",
            "expiration": int(time.time()) + 3600,
            "in_progress_expiration": int(time.time() * 1000) + 60_000,
            "validation": payload_hash,
        }
        if self.client.set(name, json.dumps(in_progress), ex=3600, nx=True):
            raise RuntimeError("no stored record to replay")
        record = json.loads(self.client.get(name))
        if record["status"] != "COMPLETED" or record["expiration"] <= time.time():
            raise RuntimeError("the stored record is not a finished one")
        if record["validation"] != payload_hash:
            raise RuntimeError("payload does not match the stored record")
        return json.loads(record["data"])
