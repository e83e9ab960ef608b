"""Server instructions per fresh-key request, counted by valgrind's callgrind in the
PostgreSQL backends that serve it; and what the key table's rows and updates look like after.

    python benchmarks/server_instructions.py [--requests 200]

The server's CPU time per request, read from ``/proc``, swung by ±30 % between runs of
the same code on this shared 2-core machine; the instructions its backends execute do not.
This starts a private PostgreSQL of this machine's own binaries (``pg_config --bindir``,
as ``run.py``'s sized server) under ``valgrind --tool=callgrind`` (each backend writes its
count when it exits), and for each flow of ``run.py`` (the hand-written reference, the sync
``Engine`` and the work alone) runs a child process twice, once with the warm-up alone and
once with ``--requests`` more fresh-key requests after it, one client; the median of three such
differences of the instructions of the backends each child used, per request (after an
untimed child per flow, whose backend's first connection builds the server's caches), is
the server's own cost of a
request in user space: parsing, planning, executing, committing. The kernel's side
(sockets, the WAL flush) is not counted; the round trips are counted by
tests/test_round_trips.py. Needs valgrind (Debian's package); about 4 minutes.

Then, from the same database: the key row's average size, and how many of the key table's
updates were HOT (no index entry written), for both flows' key tables.

``--after-migrate SQL`` runs SQL on the database once it is migrated, to weigh a change
of the schema before writing its migration: ``--after-migrate "DROP INDEX
idempotency_keys_unfinished; DROP INDEX idempotency_keys_finished_at"`` counts a request
on a key table whose finishing write can be HOT (the workers' scans would need another
way to their keys). The file written says so.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))

import facts as machine
from claims import binaries, free_port, initdb
from flows import SCHEMA
from instructions import FLOWS, WARM_UP, beyond_the_work, require, sync_flow

from recoverypoint.migrate import upgrade

HERE = Path(__file__).resolve().parent
ROUNDS = 3  # each figure is the median of this many differences
DATABASE = "bench"
KEY_TABLES = {"reference": "rr_idempotency_keys", "recoverypoint": "idempotency_keys"}


def child(url: str, flow_name: str, requests: int) -> None:
    """The warm-up and ``requests`` fresh keys of one flow, one client."""
    flow = sync_flow(url, flow_name)
    for _ in range(WARM_UP + requests):
        flow.run(uuid.uuid4().hex)
    # The backends the flow used, for the parent to read the counts of: every other one.
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    print(" ".join(str(pid) for (pid,) in rows))
    flow.close()


@contextmanager
def callgrind_server() -> Iterator[tuple[str, Path]]:
    """A private PostgreSQL under callgrind; yields its admin URL and the directory each
    backend's count lands in (``cg.<pid>``). Autovacuum off: no process but the measured
    backends comes and goes."""
    bindir, as_user = binaries()
    root = Path(tempfile.mkdtemp(prefix="recoverypoint-server-instructions-"))
    data, counts = root / "data", root / "counts"
    data.mkdir()
    counts.mkdir()
    if as_user:  # the server reads and writes below root
        for path in (root, counts):
            shutil.chown(path, "postgres")
    initdb(data)
    port = free_port()
    command = [
        *as_user, "valgrind", "--tool=callgrind", f"--callgrind-out-file={counts}/cg.%p",
        str(bindir / "postgres"), "-D", str(data), "-p", str(port),
        "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={data}",
        "-c", "autovacuum=off", "-c", "max_connections=20",
    ]  # fmt: skip
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        _wait_until_up(url, server)
        yield url, counts
    finally:
        # Fast shutdown, sent to the server itself: runuser does not pass signals on.
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGINT)
        server.wait(timeout=120)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_until_up(url: str, server: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise RuntimeError("the server under callgrind exited; see its server.log")
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise RuntimeError("the server under callgrind did not start in 2 minutes")


def counted(url: str, counts: Path, flow_name: str, requests: int) -> int:
    """Instructions of the backends a child running ``requests`` after the warm-up used."""
    command = [
        sys.executable, __file__, "--child", flow_name, "--database-url", url,
        "--requests", str(requests),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    pids = done.stdout.split()
    assert pids, "the child named no backend"
    total, deadline = 0, time.monotonic() + 120
    for pid in pids:
        # A backend writes its count as it exits, after its client hung up.
        while (found := _total(counts / f"cg.{pid}")) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"backend {pid} wrote no count")
            time.sleep(0.2)
        total += found
    return total


def _total(path: Path) -> int | None:
    if not path.exists():
        return None
    match = re.search(r"^(?:summary|totals): (\d+)", path.read_text(), re.MULTILINE)
    return None if match is None else int(match[1])


def key_tables(url: str) -> dict[str, tuple[float, int, int]]:
    """Each flow's key table: the average row size in bytes, updates, HOT updates."""
    found = {}
    with psycopg.connect(url) as conn:
        for flow_name, table in KEY_TABLES.items():
            size = conn.execute(f"SELECT avg(pg_column_size(k.*)) FROM {table} AS k").fetchone()
            updates = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s",
                (table,),
            ).fetchone()
            assert size is not None and updates is not None
            found[flow_name] = (float(size[0]), int(updates[0]), int(updates[1]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--after-migrate", metavar="SQL", help="run on the migrated database")
    parser.add_argument("--database-url", help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--child", choices=FLOWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.database_url, args.child, args.requests)
        return
    require("valgrind")
    with (
        callgrind_server() as (admin_url, counts),
        psycopg.connect(admin_url, autocommit=True) as admin,
    ):
        admin.execute(f"CREATE DATABASE {DATABASE}")
        url = admin_url.rsplit("/", 1)[0] + f"/{DATABASE}"
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
            if args.after_migrate:
                conn.execute(args.after_migrate)
        lines = [f"server instructions per fresh-key request ({args.requests} requests each)"]
        if args.after_migrate:
            lines.append(f"  on the schema as migrated, then: {args.after_migrate}")
        print("\n".join(lines), flush=True)
        printed = len(lines) + len(FLOWS)
        for flow_name in FLOWS:  # untimed: a backend's first connection to the database
            counted(url, counts, flow_name, 0)  # builds caches that later ones read
        per_request = {}
        for flow_name in FLOWS:
            extras = [
                counted(url, counts, flow_name, args.requests) - counted(url, counts, flow_name, 0)
                for _ in range(ROUNDS)
            ]
            per_request[flow_name] = statistics.median(extras) / args.requests
            spread = ", ".join(f"{extra / args.requests / 1000:,.0f}k" for extra in extras)
            lines.append(f"  {flow_name:14} {per_request[flow_name] / 1000:8,.0f}k  ({spread})")
            print(lines[-1], flush=True)
        ratio = per_request["recoverypoint"] / per_request["reference"]
        lines.append(f"  recoverypoint / reference: {ratio:.2f}")
        lines.append(beyond_the_work(per_request))
        lines.append("key tables after both (row: average bytes; HOT: updates writing no index)")
        for flow_name, (size, updates, hot) in key_tables(url).items():
            share = hot / updates if updates else 0.0
            lines.append(
                f"  {flow_name:14} row {size:5.0f} B, HOT {hot:,} of {updates:,} ({share:.0%})"
            )
        print("\n".join(lines[printed:]))  # the rest of the figures
        facts = machine.collect(HERE.parent, admin_url, None)
    write(args.results, facts, lines)


def write(results: Path, facts: dict[str, Any], lines: list[str]) -> None:
    """``server_instructions.md`` in ``results``: the command, the machine, the figures."""
    command = shlex.join(["python", *sys.argv])
    text = "\n".join(
        [
            "# Server instructions per fresh-key request",
            "",
            f"Written by `benchmarks/server_instructions.py` (`{command}`): PostgreSQL under "
            "callgrind, one client, the median of 3 differences; reported, never asserted.",
            "",
            *machine.markdown(facts),
            "",
            "```",
            *lines,
            "```",
            "",
        ]
    )
    results.mkdir(parents=True, exist_ok=True)
    (results / "server_instructions.md").write_text(text)
    print(f"written: {results / 'server_instructions.md'}")


if __name__ == "__main__":
    main()
