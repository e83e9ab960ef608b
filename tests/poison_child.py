"""A process that a poison key kills: the client of one request, one call of an
``@idempotent`` function, or one completer pass, on either engine. Usage:
poison_child.py DATABASE_URL client|idempotent|completer sync|async KIND [KEY]

The poison operation (:func:`poison_operation`) records the call of its poison phase in
``step_calls`` (workload.py's table, on a connection of its own, committed at once, as a
foreign system would), then kills the process: ``step`` (a foreign step) and ``phase``
(an atomic phase) with ``os._exit``, ``kill`` by blocking until the test SIGKILLs it;
``first`` is an atomic phase too, the operation's first, which shares the claim's
transaction (and writes a ``phase_runs`` row in it before it dies).
The client prints its answer as JSON (the function's caller, the AbandonedCall it got);
the completer, its pass's counts. The tests run it through :func:`forked`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from workload import Recorder, async_steps_operation, steps_operation

import recoverypoint as rp
from recoverypoint.workers import Completer

DIED = 86
"""The exit status of a process the poison phase killed with ``os._exit``."""
MAX_ATTEMPTS = 3
LOCK_TIMEOUT = timedelta(seconds=5)
SCOPE = "planted"  # workload.plant_keys's: the healthy keys share the poison key's batch


def poisoned(recorder: Recorder, kind: str, key_id: int) -> None:
    """Record the call of key ``key_id``'s poison phase, then kill the process."""
    recorder.step_called(key_id)
    if kind == "kill":
        threading.Event().wait()  # until SIGKILL
    os._exit(DIED)


def poison_operation(kind: str, recorder: Recorder, asynchronous: bool) -> rp.Operation[Any]:
    """prepared (a foreign step that does nothing, so the claim commits alone; none for
    ``first``) → poisoned (``kind``) → finished (201, never reached)."""
    op: rp.Operation[Any] = rp.Operation(
        f"poison_{kind}", max_attempts=MAX_ATTEMPTS, lock_timeout=LOCK_TIMEOUT
    )

    def die(key_id: int) -> None:
        poisoned(recorder, kind, key_id)

    written = "INSERT INTO phase_runs (key_id, phase, pid) VALUES (%s, 'poisoned', %s)"
    if asynchronous:
        if kind != "first":

            @op.foreign_step("prepared")
            async def prepare_async(step: rp.StepContext, params: Any) -> None:
                return None

        if kind in ("phase", "first"):

            @op.atomic_phase("poisoned")
            async def poison_atomic_async(tx: rp.AsyncAtomicContext, params: Any) -> None:
                await tx.execute(written, (tx.key_id, os.getpid()))
                die(tx.key_id)

        else:

            @op.foreign_step("poisoned")
            async def poison_step_async(step: rp.StepContext, params: Any) -> None:
                die(step.key_id)

        @op.atomic_phase("finished")
        async def finish_async(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
            return rp.Response(201, {})

        return op

    if kind != "first":

        @op.foreign_step("prepared")
        def prepare(step: rp.StepContext, params: Any) -> None:
            return None

    if kind in ("phase", "first"):

        @op.atomic_phase("poisoned")
        def poison_atomic(tx: rp.AtomicContext, params: Any) -> None:
            tx.execute(written, (tx.key_id, os.getpid()))
            die(tx.key_id)

    else:

        @op.foreign_step("poisoned")
        def poison_step(step: rp.StepContext, params: Any) -> None:
            die(step.key_id)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {})

    return op


def engine_with(
    url: str, flavour: str, kind: str
) -> tuple[rp.Engine | rp.AsyncEngine, rp.Operation[Any]]:
    """An engine of ``flavour`` with the poison operation of ``kind`` and the healthy one
    (workload's three phases, ``healthy``, as few attempts as the poison one) registered."""
    recorder = Recorder(sa.create_engine(url))
    asynchronous = flavour == "async"
    poison = poison_operation(kind, recorder, asynchronous)
    healthy = (async_steps_operation if asynchronous else steps_operation)(
        "healthy", recorder, max_attempts=MAX_ATTEMPTS
    )
    engine = rp.AsyncEngine(url) if asynchronous else rp.Engine(url)
    engine.register(poison, healthy)
    return engine, poison


def call_idempotent(url: str, flavour: str, kind: str, key: str) -> dict[str, Any]:
    """Call an ``@idempotent`` function whose body is the poison, with ``key``."""
    db = sa.create_engine(url)
    recorder = Recorder(db)
    options: dict[str, Any] = {
        "key": "order_id",
        "name": "poison_call",
        "max_attempts": MAX_ATTEMPTS,
        "lock_timeout": LOCK_TIMEOUT,
    }

    def poison(order_id: str) -> None:
        with db.connect() as conn:
            query = "SELECT id FROM idempotency_keys WHERE idempotency_key = :k"
            poisoned(recorder, kind, conn.execute(sa.text(query), {"k": order_id}).scalar_one())

    try:
        if flavour == "async":

            @rp.idempotent(rp.AsyncEngine(url), **options)
            async def charge_async(order_id: str) -> str:
                poison(order_id)
                return "never"

            return {"returned": asyncio.run(charge_async(key))}

        @rp.idempotent(rp.Engine(url), **options)
        def charge(order_id: str) -> str:
            poison(order_id)
            return "never"

        return {"returned": charge(key)}
    except rp.AbandonedCall as exc:
        return {"abandoned": str(exc)}


def main(args: list[str]) -> None:
    url, role, flavour, kind = args[:4]
    if role == "idempotent":
        print(json.dumps(call_idempotent(url, flavour, kind, args[4])))
        return
    engine, poison = engine_with(url, flavour, kind)
    if role == "completer":
        result = Completer(engine, min_age=0).run_once()
        print(json.dumps(dataclasses.asdict(result)))
        return
    key = args[4]
    if isinstance(engine, rp.AsyncEngine):
        outcome = asyncio.run(engine.run(poison, key=key, params={}, scope=SCOPE))
    else:
        outcome = engine.run(poison, key=key, params={}, scope=SCOPE)
    print(
        json.dumps({"status": outcome.status, "body": outcome.body, "replayed": outcome.replayed})
    )


def forked(args: list[str], output: str) -> None:
    """:func:`main` in a process forked from a server that imported this module (a fresh
    interpreter's imports cost more than the request), its output written to ``output``."""
    written = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(written, 1)
    os.dup2(written, 2)
    try:
        main(args)
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
