"""PostgreSQL clusters of the tests' own: a primary and a streaming standby made with the
machine's PostgreSQL 15 binaries (``initdb``, ``pg_basebackup -R``) on free loopback ports
under a temporary directory, and Debian's PgBouncer in front of the primary. Servers run as
the ``postgres`` OS user (``runuser`` when the tests run as root); the server on 5432 is
never touched.

Every wait is on an event (the server answers, a view shows a row), bounded by a deadline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from ports import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
PGBOUNCER = Path("/usr/sbin/pgbouncer")
OS_USER = "postgres"
DATABASE = "rp"

# Appended to the template's postgresql.conf, so every primary and standby made from it has
# them. fsync off: a server's crash is simulated (immediate stop), never the machine's.
SETTINGS = """
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
wal_keep_size = '256MB'
hot_standby = on
fsync = off
max_connections = 150
# A standby whose sender went away tries again soon, so a rebuilt one streams at once.
wal_retrieve_retry_interval = '200ms'
wal_receiver_status_interval = '1s'
"""


def missing() -> list[str]:
    """What this machine lacks to run clusters, in words; empty when nothing."""
    lacking = [str(p) for p in (BIN / "initdb", BIN / "pg_basebackup", PGBOUNCER) if not p.exists()]
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        lacking.append("runuser")
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam(OS_USER)
        except KeyError:
            lacking.append(f"the {OS_USER!r} OS user")
    return lacking


def _as_server_user(*command: str | Path | int) -> list[str]:
    argv = [str(part) for part in command]
    return ["runuser", "-u", OS_USER, "--", *argv] if os.geteuid() == 0 else argv


def run(*command: str | Path | int, timeout: float = 60) -> str:
    """Run ``command`` as the server's OS user; its output, or an error that shows it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    done = subprocess.run(
        _as_server_user(*command),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


def _owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(path, OS_USER, OS_USER)
    return path


@dataclass
class Server:
    """One PostgreSQL server: a data directory and the port it listens on."""

    name: str
    datadir: Path
    port: int
    sockets: Path

    @property
    def log(self) -> Path:
        return self.datadir.parent / f"{self.name}.log"

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.sockets}"
        run(BIN / "pg_ctl", "-D", self.datadir, "-l", self.log, "-w", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        run(BIN / "pg_ctl", "-D", self.datadir, "-m", mode, "-w", "stop")

    def running(self) -> bool:
        if not (self.datadir / "postmaster.pid").exists():
            return False
        status = _as_server_user(BIN / "pg_ctl", "-D", self.datadir, "status")
        return subprocess.run(status, capture_output=True, check=False).returncode == 0

    def query(self, sql: str, database: str = DATABASE) -> list[tuple[Any, ...]]:
        """``sql`` on a connection of its own, committed."""
        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(sql)
            return cursor.fetchall() if cursor.description else []

    def value(self, sql: str, database: str = DATABASE) -> Any:
        return self.query(sql, database)[0][0]

    def answers(self) -> bool:
        try:
            self.query("SELECT 1", "postgres")
        except psycopg.OperationalError:
            return False
        return True

    def in_recovery(self) -> bool:
        return bool(self.value("SELECT pg_is_in_recovery()", "postgres"))


@dataclass
class Template:
    """A stopped, initialized data directory with the test database in it, copied (much
    faster than initdb and migrating again) for every cluster's primary."""

    datadir: Path


@contextmanager
def template(prepare: Callable[[str], None]) -> Iterator[Template]:
    """initdb, the settings above, trust for loopback (initdb's default, replication
    included), the ``rp`` database, and ``prepare(url)`` (migrations, tables) run on it."""
    root = _owned_dir(Path(tempfile.mkdtemp(prefix="rp-pgtemplate-")))
    try:
        datadir = root / "data"
        run(BIN / "initdb", "-D", datadir, "-U", "postgres", "--auth=trust", "-E", "UTF8",
            "--no-sync", "--no-instructions")  # fmt: skip
        with (datadir / "postgresql.conf").open("a") as conf:
            conf.write(SETTINGS)
        server = Server("template", datadir, free_port(), root)
        server.start()
        try:
            server.query(f"CREATE DATABASE {DATABASE}", "postgres")
            prepare(server.url())
        finally:
            server.stop()
        yield Template(datadir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Cluster:
    """A primary and, unless it died, a streaming standby (physical slot, so the primary
    keeps every WAL segment the standby has not received)."""

    root: Path
    primary: Server
    standby: Server | None
    synchronous: bool
    dead: list[Server] = field(default_factory=list)
    _slots: int = 0

    @property
    def servers(self) -> list[Server]:
        return [s for s in (self.primary, self.standby, *self.dead) if s is not None]

    def url(self) -> str:
        """Every server of the cluster in one libpq multi-host URL that finds the primary."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sorted(self.servers, key=lambda s: s.name))
        return f"postgresql://postgres@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def sqlalchemy_url(self) -> str:
        """The same servers in SQLAlchemy's repeated ``host`` form."""
        servers = sorted(self.servers, key=lambda s: s.name)
        hosts = "&".join(f"host=127.0.0.1:{s.port}" for s in servers)
        return f"postgresql://postgres@/{DATABASE}?{hosts}&target_session_attrs=read-write"

    # -- standbys ----------------------------------------------------------------------

    def add_standby(self, server: Server) -> None:
        """Make ``server`` (its data directory emptied) a streaming standby of the primary."""
        shutil.rmtree(server.datadir, ignore_errors=True)
        self._slots += 1
        slot = f"standby_{self._slots}"
        run(BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", self.primary.port, "-U", "postgres",
            "-D", server.datadir, "-R", "-X", "stream", "-c", "fast", "-C", "-S", slot,
            "--no-sync")  # fmt: skip
        # Its walreceiver's application_name, which synchronous_standby_names matches.
        with (server.datadir / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"cluster_name = '{server.name}'\n")
        server.start()
        self.standby = server
        with suppress(ValueError):
            self.dead.remove(server)
        wait_until(lambda: self._streaming(server), f"{server.name} streams from the primary")
        names = f"'{server.name}'" if self.synchronous else "''"
        self.primary.query(f"ALTER SYSTEM SET synchronous_standby_names = {names}", "postgres")
        self.primary.query("SELECT pg_reload_conf()", "postgres")
        if self.synchronous:
            wait_until(lambda: self._sync_state(server) == "sync", f"{server.name} is synchronous")

    def _sync_state(self, server: Server) -> str | None:
        rows = self.primary.query(
            f"SELECT sync_state FROM pg_stat_replication WHERE application_name = '{server.name}'"
            " AND state = 'streaming'",
            "postgres",
        )
        return rows[0][0] if rows else None

    def _streaming(self, server: Server) -> bool:
        return self._sync_state(server) is not None

    def caught_up(self) -> bool:
        """The standby has replayed all the WAL the primary has written."""
        assert self.standby is not None
        lsn = self.primary.value("SELECT pg_current_wal_lsn()::text", "postgres")
        return bool(
            self.standby.value(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn", "postgres")
        )

    def lag(self) -> None:
        """Cut the asynchronous standby off: from now on it receives no WAL, so what the
        primary commits next is lost by a failover. (Its walreceiver is pointed at a port
        nothing listens on; the primary's view shows the sender gone.)"""
        assert self.standby is not None and not self.synchronous
        standby = self.standby
        dead = f"host=127.0.0.1 port={free_port()} user=postgres connect_timeout=1"
        standby.query(f"ALTER SYSTEM SET primary_conninfo = '{dead}'", "postgres")
        standby.query("SELECT pg_reload_conf()", "postgres")
        wait_until(
            lambda: (
                not self._streaming(standby)
                and not standby.query(
                    "SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming'", "postgres"
                )
            ),
            f"{standby.name} stops receiving WAL",
        )

    # -- failures ----------------------------------------------------------------------

    def stop_immediate(self) -> None:
        """The primary dies: no shutdown checkpoint, no WAL sent on the way out."""
        self.primary.stop("immediate")
        self.dead.append(self.primary)

    def promote(self) -> None:
        """The standby becomes the primary; returns once it accepts writes."""
        assert self.standby is not None
        new = self.standby
        run(BIN / "pg_ctl", "-D", new.datadir, "-w", "promote")
        wait_until(lambda: not new.in_recovery(), f"{new.name} accepts writes")
        if self.primary.running():  # a switchover: the old primary must not take writes
            self.primary.stop("immediate")
        if self.primary not in self.dead:
            self.dead.append(self.primary)
        self.primary, self.standby = new, None

    def failback(self) -> None:
        """Rebuild the dead old primary as a standby of the new one (same port, new data)."""
        assert self.standby is None and self.dead
        self.add_standby(self.dead[0])

    def restart(self, mode: str = "immediate") -> None:
        """The primary crashes (or stops) and starts again; returns once it answers."""
        self.primary.stop(mode)
        self.primary.start()
        wait_until(self.primary.answers, "the primary answers again")

    def terminate_backends(self) -> int:
        """pg_terminate_backend on every client backend of the primary; how many."""
        return int(
            self.primary.value(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
                "postgres",
            )
        )


@contextmanager
def cluster(
    base: Template, *, standby: bool = True, synchronous: bool = False
) -> Iterator[Cluster]:
    """A primary copied from ``base`` and, with ``standby``, a standby streaming from it,
    synchronously or not; every server stopped and every file removed on the way out."""
    root = _owned_dir(Path(tempfile.mkdtemp(prefix="rp-pgcluster-")))
    primary = Server("pg_a", root / "pg_a", free_port(), root)
    made = Cluster(root, primary, None, synchronous)
    try:
        run("cp", "-a", base.datadir, primary.datadir)
        primary.start()
        if standby:
            made.add_standby(Server("pg_b", root / "pg_b", free_port(), root))
        yield made
    finally:
        for server in made.servers:
            if server.running():
                with suppress(Exception):
                    server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


# -- PgBouncer -------------------------------------------------------------------------------


@dataclass
class PgBouncer:
    """Debian's PgBouncer in transaction pooling mode, in front of one server."""

    root: Path
    port: int

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def admin(self, command: str) -> str:
        """A command on the admin console (the ``pgbouncer`` database), by psql: the
        console speaks only the simple query protocol."""
        return run(BIN / "psql", "-X", "-h", "127.0.0.1", "-p", self.port, "-U", "postgres",
                   "-d", "pgbouncer", "-c", command, timeout=30)  # fmt: skip


@contextmanager
def pgbouncer(server: Server, **settings: str | int) -> Iterator[PgBouncer]:
    """PgBouncer on a free port, pointing at ``server``, stopped on the way out."""
    root = _owned_dir(Path(tempfile.mkdtemp(prefix="rp-pgbouncer-")))
    bouncer = PgBouncer(root, free_port())
    config = {
        "listen_addr": "127.0.0.1",
        "listen_port": bouncer.port,
        "unix_socket_dir": root,
        "auth_type": "trust",
        "auth_file": root / "users.txt",  # trust still wants the user listed
        "admin_users": "postgres",
        "pool_mode": "transaction",
        "max_client_conn": 500,
        "default_pool_size": 20,
        "ignore_startup_parameters": "extra_float_digits",
        "logfile": root / "pgbouncer.log",
        "pidfile": root / "pgbouncer.pid",
        **settings,
    }
    lines = ["[databases]", f"* = host=127.0.0.1 port={server.port}", "[pgbouncer]"]
    lines += [f"{name} = {value}" for name, value in config.items()]
    (root / "users.txt").write_text('"postgres" ""\n')
    (root / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
    if os.geteuid() == 0:
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(root / name, OS_USER, OS_USER)
    try:
        run(PGBOUNCER, "-d", root / "pgbouncer.ini")
        wait_until(lambda: _bouncer_answers(bouncer), "PgBouncer answers")
        yield bouncer
    finally:
        pidfile = root / "pgbouncer.pid"
        if pidfile.exists():
            with suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text()), 15)
            wait_until(lambda: not pidfile.exists(), "PgBouncer exits", timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def _bouncer_answers(bouncer: PgBouncer) -> bool:
    try:
        bouncer.admin("SHOW VERSION")
    except RuntimeError:
        return False
    return True
