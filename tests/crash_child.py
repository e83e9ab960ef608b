"""Runs one ride request in a child process whose faults come from the environment, so an
``exit`` fault kills it as SIGKILL would. Usage: crash_child.py DATABASE_URL SCOPE KEY"""

from __future__ import annotations

import sys
from datetime import timedelta

import sqlalchemy as sa
from rides import Faults, Provider, ride_operation

import recoverypoint as rp

url, scope, key = sys.argv[1:4]
db = sa.create_engine(url)
engine = rp.Engine(db)
op = ride_operation("create_ride", Provider(db), Faults(), lock_timeout=timedelta(seconds=1))
engine.register(op)
outcome = engine.run(op, key=key, params={"scope": scope}, scope=scope)
print(outcome.status)
