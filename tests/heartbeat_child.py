"""Runs one request of tests/heartbeats.py's operation whose foreign step never returns,
for the test to kill mid-call. Usage: heartbeat_child.py DATABASE_URL SCOPE sync|async"""

from __future__ import annotations

import asyncio
import sys

from heartbeats import Mailer, operation

import recoverypoint as rp
from recoverypoint.database import create_engine

url, scope, kind = sys.argv[1:4]
mailer = Mailer(create_engine(url))
op = operation(kind, mailer)
if kind == "sync":
    engine = rp.Engine(url)
    engine.register(op)
    engine.run(op, key="k", params={"scope": scope}, scope=scope)
else:
    async_engine = rp.AsyncEngine(url)
    async_engine.register(op)
    asyncio.run(async_engine.run(op, key="k", params={"scope": scope}, scope=scope))
