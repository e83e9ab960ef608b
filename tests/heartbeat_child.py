"""Runs one request of tests/heartbeats.py's operation whose foreign step never returns,
for the test to kill mid-call. Usage: heartbeat_child.py DATABASE_URL SCOPE sync|async
[fork]. With ``fork``, once the step is called, the process forks, as a pre-forking server
does, and the forked child runs a request of its own (see :func:`fork`), prints its pid once
its step is called, and lives until its stdin closes."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from heartbeats import Mailer, operation

import recoverypoint as rp
from recoverypoint.database import create_engine

url, scope, kind = sys.argv[1:4]
mailer = Mailer(create_engine(url))
op = operation(kind, mailer)
engine: rp.Engine | rp.AsyncEngine = rp.Engine(url) if kind == "sync" else rp.AsyncEngine(url)


def fork() -> None:
    """Fork mid-step; in the child, run a request of its own (in scope ``SCOPE-fork``)
    whose step never returns either, after dropping the pools' inherited connections as a
    pre-forking server does."""
    assert mailer.calling.wait(60)
    if os.fork() != 0:
        return
    for db in (mailer.db, engine.db):
        db.dispose(close=False)
    if isinstance(engine, rp.AsyncEngine):
        engine.async_db.sync_engine.dispose(close=False)
    mailer.steps, mailer.calling, mailer.gate = [], threading.Event(), threading.Event()

    def report() -> None:
        assert mailer.calling.wait(60)
        print(os.getpid(), flush=True)
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=report, daemon=True).start()
    own = f"{scope}-fork"
    if isinstance(engine, rp.Engine):
        engine.run(op, key="k", params={"scope": own}, scope=own)
    else:
        asyncio.run(engine.run(op, key="k", params={"scope": own}, scope=own))


if sys.argv[4:] == ["fork"]:
    threading.Thread(target=fork, daemon=True).start()
engine.register(op)
if isinstance(engine, rp.Engine):
    engine.run(op, key="k", params={"scope": scope}, scope=scope)
else:
    asyncio.run(engine.run(op, key="k", params={"scope": scope}, scope=scope))
