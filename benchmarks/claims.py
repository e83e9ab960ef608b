"""The claim statement alone, in an empty key table and in one holding many finished keys.

The stored keys share the measured claims' scope and operation, and their key strings are
spread evenly over the space of UUID strings, so a claim's fresh uuid4 lands among them in
the unique index (as in a busy service's table), not in a corner of its own. They are
inserted in ascending order, which keeps the fill fast (every index insert goes to the
right-most page); the unique index is then rebuilt at the leaf density random inserts
leave: about 20 s per million keys in all on this 2-core machine. The filled database is
kept between runs (``rp_bench_keys_<count>``) so the fill happens once.

The claim is measured twice: on the server the benchmark runs against, and on a private
server of this machine's own PostgreSQL configured as the README's table of database
settings says (:func:`sized_server`): ``shared_buffers`` that hold the key table's indexes,
``wal_compression = lz4``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint.engine import store
from recoverypoint.engine._decide import ClaimRequest
from recoverypoint.keys import fingerprint
from recoverypoint.migrate import upgrade

# The tests' loopback ports (below the ephemeral range) for the servers started here, and by
# reaper_soak and server_instructions through this module.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ports import free_port as free_port  # for reaper_soak and server_instructions

SCOPE, OPERATION = "bench", "claim_only"
CHUNK = 1_000_000

# Each key as a request ``POST /x`` with params ``{}`` left it, fingerprint included, so that
# ``Engine.run`` replays it (scale.py).
FILL = """
    INSERT INTO idempotency_keys (scope, operation, idempotency_key, operation_version,
        request_method, request_path, request_params, fingerprint, recovery_point,
        response_status, response_headers, response_body, finished_at)
    SELECT %(scope)s, %(operation)s,
        lpad(to_hex(i * 4294967296 / %(count)s), 8, '0') || '-0000-4000-8000-'
            || lpad(to_hex(i), 12, '0'),
        1, 'POST', '/x', '{}', %(fingerprint)s, 'finished', 201, '{}', '{}',
        now() - interval '1 day' + i * interval '1 day' / %(count)s
    FROM generate_series(%(low)s::bigint, %(high)s::bigint) AS i
"""

# The marker of a finished fill; its name changes with the fill's recipe, so that a database
# filled by an older recipe is filled again.
MARKER = "rp_bench_fill_v3"


def big_database_name(count: int) -> str:
    return f"rp_bench_keys_{count}"


def ensure_filled(
    admin_url: str, url: str, count: int, fresh: bool, progress: Callable[[str], None]
) -> float:
    """Make sure the database at ``url`` (named by :func:`big_database_name`) holds
    ``count`` finished keys; returns the seconds spent filling (0 when cached)."""
    import time

    name = sa.make_url(url).database
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists and fresh:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            exists = None
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    upgrade(url)  # a cached database follows the checkout's migrations
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {MARKER} (keys bigint NOT NULL, last_id bigint NOT NULL)"
        )
        row = conn.execute(f"SELECT keys FROM {MARKER}").fetchone()
        if row is not None and row[0] == count:
            return 0.0
        began = time.perf_counter()
        conn.execute(f"TRUNCATE idempotency_keys, {MARKER}")
        conn.execute("SET synchronous_commit = off")
        for low in range(0, count, CHUNK):
            high = min(count, low + CHUNK) - 1
            progress(f"storing {count:,} keys: {low:,} so far")
            conn.execute(
                FILL,
                {
                    "scope": SCOPE,
                    "operation": OPERATION,
                    "fingerprint": fingerprint("POST", "/x", "{}"),
                    "count": count,
                    "low": low,
                    "high": high,
                },
            )
        # Ascending inserts leave the unique index's leaves 90% full, where random keys
        # (a service's uuid4s) leave them about 70% full: rebuild it at that density, or
        # nearly every measured claim would split a page.
        unique = conn.execute(
            "SELECT indexrelid::regclass::text FROM pg_index "
            "WHERE indrelid = 'idempotency_keys'::regclass AND indisunique AND NOT indisprimary"
        ).fetchall()
        for (index,) in unique:
            progress(f"storing {count:,} keys: REINDEX {index} at 70% leaf fill")
            conn.execute(f"ALTER INDEX {index} SET (fillfactor = 70)")
            conn.execute(f"REINDEX INDEX {index}")
        progress(f"storing {count:,} keys: VACUUM ANALYZE")
        conn.execute("VACUUM ANALYZE idempotency_keys")
        # Flush the fill's dirty pages now, so the measurement does not pay for the
        # checkpoint it would trigger (nor for the full-page writes after one).
        conn.execute("CHECKPOINT")
        conn.execute(
            f"INSERT INTO {MARKER} SELECT %s, coalesce(max(id), 0) FROM idempotency_keys",
            (count,),
        )
        return time.perf_counter() - began


# What a stored key takes in the key table's indexes at the leaf density random keys leave
# (the unique index about 95 bytes, the primary key and the finished_at index about 21 each),
# rounded up: the sized server's shared_buffers hold them, plus room for the rest.
INDEX_BYTES_PER_KEY = 160
BASE_BUFFERS_MB = 256


def sized_directory(count: int) -> Path:
    return Path(tempfile.gettempdir()) / f"recoverypoint-bench-sized-{count}"


def sized_settings(count: int, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """What the sized server sets beyond PostgreSQL's defaults (the README's table), and
    ``overrides`` over it."""
    buffers_mb = BASE_BUFFERS_MB + count * INDEX_BYTES_PER_KEY // 2**20
    return {"shared_buffers": f"{buffers_mb}MB", "wal_compression": "lz4", **(overrides or {})}


@contextmanager
def sized_server(
    count: int, progress: Callable[[str], None], overrides: dict[str, str] | None = None
) -> Iterator[str]:
    """Start a private PostgreSQL of this machine's own binaries (``pg_config --bindir``),
    configured for ``count`` stored keys as the README's database settings say (and the
    settings in ``overrides``); yield its admin URL; stop it. Its data directory is kept
    (:func:`sized_directory`), so the keys are stored once; the indexes are read into
    ``shared_buffers`` after each start, as a server that has been serving them holds them."""
    bindir, as_user = binaries()
    data = sized_directory(count)
    if not (data / "PG_VERSION").exists():
        progress(f"initdb for the sized server in {data}")
        data.mkdir(parents=True, exist_ok=True)
        initdb(data)
    port = free_port()
    settings = " ".join(f"-c {k}={v}" for k, v in sized_settings(count, overrides).items())
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={data} "
        f"-c max_connections=50 {settings}"
    )
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-w"]
    subprocess.run(
        [*ctl, "-l", str(data / "server.log"), "-o", options, "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*ctl, "-m", "fast", "stop"], check=True, capture_output=True)


def binaries() -> tuple[Path, list[str]]:
    """This machine's PostgreSQL programs (``pg_config --bindir``), and what runs them as
    the postgres user when this runs as root, which PostgreSQL refuses."""
    bindir = Path(subprocess.check_output(["pg_config", "--bindir"], text=True).strip())
    return bindir, ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def initdb(data: Path) -> None:
    """A new cluster in the empty directory ``data`` (trust, superuser postgres)."""
    bindir, as_user = binaries()
    if as_user:
        shutil.chown(data, "postgres")
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )


def prewarm(url: str) -> None:
    """Read the key table's indexes into shared_buffers (the sized server's cold start)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
        conn.execute(
            "SELECT pg_prewarm(indexrelid) FROM pg_index "
            "WHERE indrelid = 'idempotency_keys'::regclass"
        )


def forget_claims(url: str, big: bool) -> None:
    """Delete the rows the measured claims inserted, so the next run starts from the same
    table: everything in the empty table, the rows after the fill in the big one."""
    with psycopg.connect(url, autocommit=True) as conn:
        if big:
            conn.execute(f"DELETE FROM idempotency_keys WHERE id > (SELECT last_id FROM {MARKER})")
        else:
            conn.execute("TRUNCATE idempotency_keys")


def claim_request(key: str) -> ClaimRequest:
    """What the engine asks the key table for ``key`` of the measured scope and operation."""
    return ClaimRequest(
        scope=SCOPE,
        operation=OPERATION,
        key=key,
        version=1,
        method="POST",
        path="/x",
        params_json="{}",
        fingerprint="f",
        namespace="bench",
        lock_timeout=90.0,
    )


class Claimer:
    """The claim statement in its own SERIALIZABLE transaction (the engine's own retry
    loop), fresh key each time, through the engine's internals (``store.claim``)."""

    def __init__(self, url: str) -> None:
        self.db = sa.create_engine(url, pool_size=2)
        self.engine = rp.Engine(self.db)
        with self.db.connect():
            pass  # open the connection before anything is timed

    def run(self, key: str) -> Any:
        request = claim_request(key)
        schedule = self.engine._schedule()  # a fresh key: generation 0
        return self.engine._transact(
            lambda conn: store.claim(conn, request, uuid.uuid4(), 0, schedule, bound=False)
        )

    def close(self) -> None:
        self.db.dispose()
