"""Runs one request of tests/heartbeats.py's operation whose foreign step never returns,
for the test to kill mid-call. Usage: heartbeat_child.py DATABASE_URL SCOPE sync|async
[fork]. With ``fork``, once the step is called, the process forks, as a pre-forking server
does, and the forked child holds a lease of its own on the engine's heartbeat (on a key that
does not exist) and prints its pid, then lives until its stdin closes."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid

from heartbeats import LEASE, Mailer, operation

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.engine._decide import KeyRef

url, scope, kind = sys.argv[1:4]
mailer = Mailer(create_engine(url))
op = operation(kind, mailer)
engine: rp.Engine | rp.AsyncEngine = rp.Engine(url) if kind == "sync" else rp.AsyncEngine(url)


def fork() -> None:
    """Fork mid-step; in the child, start the heartbeat again with a lease of its own."""
    assert mailer.calling.wait(60)
    if os.fork() == 0:
        engine._heartbeat.hold(KeyRef(-1, scope, uuid.uuid4(), "(0,0)"), LEASE)
        print(os.getpid(), flush=True)
        sys.stdin.read()
        os._exit(0)


if sys.argv[4:] == ["fork"]:
    threading.Thread(target=fork, daemon=True).start()
engine.register(op)
if isinstance(engine, rp.Engine):
    engine.run(op, key="k", params={"scope": scope}, scope=scope)
else:
    asyncio.run(engine.run(op, key="k", params={"scope": scope}, scope=scope))
