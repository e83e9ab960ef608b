"""Client instructions per fresh-key request, counted by valgrind's callgrind.

    python benchmarks/instructions.py --database-url URL [--requests 300]

Seconds and CPU time drift on a shared machine; the instructions a process executes do
not. For each flow this runs a child process under ``valgrind --tool=callgrind`` twice, once
with the warm-up alone and once with ``--requests`` more fresh-key requests after it, and
reports the difference per request: the client's own cost of a request, in user space
(the kernel's side of each round trip and the server's work are not counted; the
round trips are counted by tests/test_round_trips.py). Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import re
import secrets
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))

from flows import SCHEMA, RecoveryPointFlow, Reference, ride_operation

import recoverypoint as rp
from recoverypoint.database import normalize_url
from recoverypoint.migrate import upgrade

WARM_UP = 60  # psycopg prepares a statement on its 5th run; the pool fills; caches warm
FLOWS = ("reference", "recoverypoint")


def child(url: str, flow_name: str, requests: int) -> None:
    """Run the warm-up and ``requests`` fresh keys of one flow (under callgrind)."""
    flow: Any
    if flow_name == "reference":
        flow = Reference(url)
    else:
        engine = rp.Engine(url)
        operation = ride_operation()
        engine.register(operation)
        flow = RecoveryPointFlow(engine, operation)
    for _ in range(WARM_UP + requests):
        flow.run(uuid.uuid4().hex)
    flow.close()


def collected(url: str, flow_name: str, requests: int) -> int:
    """Instructions callgrind counted in a child running ``requests`` after the warm-up."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", flow_name, "--database-url", url,
        "--requests", str(requests),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no total:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--child", choices=FLOWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.database_url, args.child, args.requests)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: apt-get install -y valgrind")

    admin = normalize_url(args.database_url).set(drivername="postgresql")
    name = f"rp_instr_{secrets.token_hex(4)}"
    admin_url = admin.render_as_string(False)
    url = admin.set(database=name).render_as_string(False)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        print(f"client instructions per fresh-key request ({args.requests} requests each)")
        per_request = {}
        for flow_name in FLOWS:
            extra = collected(url, flow_name, args.requests) - collected(url, flow_name, 0)
            per_request[flow_name] = extra / args.requests
            print(f"  {flow_name:15} {per_request[flow_name] / 1000:8,.0f}k", flush=True)
        ratio = per_request["recoverypoint"] / per_request["reference"]
        print(f"  recoverypoint / reference: {ratio:.2f}")
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
