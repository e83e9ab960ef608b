"""Timed windows: requests, latencies, and the CPU they cost in the client and the server.

A window is timed only once every client thread exists, has its connection(s) open and has
sent its warm-up requests; it ends when the last client's last request returns. Over the
window we read:

* client CPU: ``time.process_time()`` of this process (every thread: the clients, the
  library under test, its pool; DBOS's background threads while DBOS is launched);
* server CPU: utime + stime from ``/proc/<pid>/stat`` of the PostgreSQL processes serving
  the benchmark's databases (client backends, and parallel or autovacuum workers on those
  databases), found in ``pg_stat_activity``; other databases' backends (other people's
  tests on a shared server) are left out, and the shared auxiliary processes (WAL writer,
  checkpointer, background writer) are counted apart, as ``server_other``;
  for Redis, ``used_cpu_user + used_cpu_sys`` from ``INFO cpu``;
* the whole machine's busy time from ``/proc/stat``, to show what else ran meanwhile.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
AUXILIARY = {
    "walwriter",
    "checkpointer",
    "background writer",
    "autovacuum launcher",
    "logical replication launcher",
    "archiver",
    "walsender",
}


def percentile(values: list[float], p: float) -> float:
    """The p-quantile (nearest rank) of ``values``; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


@dataclass
class Window:
    """One or more timed windows of one system, summed (rounds of a run, blocks of a replay)."""

    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    client_cpu: float = 0.0
    server_cpu: float | None = 0.0
    server_other_cpu: float | None = 0.0
    machine_busy: float = 0.0
    machine_steal: float = 0.0
    connections_opened: int = 0
    first_error: str = ""

    def add(self, other: Window) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.seconds += other.seconds
        self.latencies.extend(other.latencies)
        self.client_cpu += other.client_cpu
        self.server_cpu = _plus(self.server_cpu, other.server_cpu)
        self.server_other_cpu = _plus(self.server_other_cpu, other.server_other_cpu)
        self.machine_busy += other.machine_busy
        self.machine_steal += other.machine_steal
        self.connections_opened += other.connections_opened
        self.first_error = self.first_error or other.first_error

    def figures(self) -> dict[str, float | None]:
        """Per-request figures, in ms; ``None`` where the server is not on this machine."""
        n = self.requests or 1
        busy = self.machine_busy / self.seconds if self.seconds else 0.0
        ours = (self.client_cpu + (self.server_cpu or 0.0) + (self.server_other_cpu or 0.0)) / (
            self.seconds or 1
        )
        return {
            "requests_per_second": self.requests / self.seconds if self.seconds else 0.0,
            "p50_ms": percentile(self.latencies, 0.5) * 1000,
            "p99_ms": percentile(self.latencies, 0.99) * 1000,
            "client_cpu_ms": self.client_cpu / n * 1000,
            "server_cpu_ms": None if self.server_cpu is None else self.server_cpu / n * 1000,
            "server_other_cpu_ms": (
                None if self.server_other_cpu is None else self.server_other_cpu / n * 1000
            ),
            "requests": float(self.requests),
            "errors": float(self.errors),
            "connections_opened_in_window": float(self.connections_opened),
            # Cores busy on the whole machine during the window, and how many of those were
            # neither this process nor the servers it measured (other people's work).
            "machine_cores_busy": busy,
            "other_cores_busy": max(0.0, busy - ours),
            "steal_cores": self.machine_steal / self.seconds if self.seconds else 0.0,
        }


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _proc_cpu(pid: int, reaped: bool = False) -> float | None:
    """utime + stime of process ``pid`` in seconds, ``None`` if it is gone; with ``reaped``,
    plus those of its children it has waited for (cutime + cstime)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    own = int(fields[11]) + int(fields[12])
    return (own + (int(fields[13]) + int(fields[14]) if reaped else 0)) / TICK


def every_postgres_cpu() -> float:
    """utime + stime so far of every PostgreSQL process on this machine, in seconds: its
    backends, whatever their database, and its auxiliary processes, and (the postmaster's
    reaped children) those that have ended, so that a backend ending within a window does
    not take its CPU out of the count; 0.0 without ``/proc``. For a benchmark whose sides
    open their connections for their own windows (async_flow.py) and have the server to
    themselves."""
    total = 0.0
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            named = comm.read_text().strip()
        except OSError:
            continue  # gone meanwhile
        if named == "postgres":
            total += _proc_cpu(int(comm.parent.name), reaped=True) or 0.0
    return total


def _machine() -> tuple[float, float]:
    """The whole machine's busy and stolen CPU time so far, in seconds (all cores)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    return (user + nice + system + irq + softirq) / TICK, steal / TICK


class PostgresCPU:
    """CPU of the PostgreSQL processes serving ``databases``, read from /proc."""

    def __init__(self, admin_url: str, databases: Iterable[str]) -> None:
        self.databases = set(databases)
        self.conn = psycopg.connect(admin_url, autocommit=True)
        row = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        pid = row[0] if row else -1
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = ""
        # The server is on this machine, in this PID namespace, if our own backend is there.
        self.local = comm.startswith("postgres")

    def processes(self) -> dict[int, str]:
        """pid -> "client" (a connection to one of our databases), "worker" (a parallel or
        autovacuum worker on one), or "aux" (a shared auxiliary process)."""
        rows = self.conn.execute(
            "SELECT pid, backend_type, datname FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        ).fetchall()
        found = {}
        for pid, backend_type, datname in rows:
            if datname in self.databases:
                found[pid] = "client" if backend_type == "client backend" else "worker"
            elif datname is None and backend_type in AUXILIARY:
                found[pid] = "aux"
        return found

    def close(self) -> None:
        self.conn.close()


class RedisCPU:
    def __init__(self, client: Any) -> None:
        self.client = client

    def read(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Meter:
    """Reads the CPU counters around a window; ``server`` says whose server CPU counts."""

    def __init__(self, postgres: PostgresCPU, redis: RedisCPU | None = None) -> None:
        self.postgres = postgres
        self.redis = redis

    def before(self, server: str) -> dict[str, Any]:
        snap: dict[str, Any] = {"server": server}
        if server == "postgres" and self.postgres.local:
            snap["processes"] = self.postgres.processes()
        snap["pg"] = {pid: _proc_cpu(pid) for pid in snap.get("processes", {})}
        if server == "redis" and self.redis is not None:
            snap["redis"] = self.redis.read()
        snap["machine"] = _machine()
        snap["client"] = time.process_time()
        return snap

    def after(self, snap: dict[str, Any], window: Window) -> None:
        window.client_cpu = time.process_time() - snap["client"]
        machine = _machine()
        window.machine_busy = machine[0] - snap["machine"][0]
        window.machine_steal = machine[1] - snap["machine"][1]
        if snap["server"] == "redis":
            window.server_other_cpu = 0.0
            window.server_cpu = (
                self.redis.read() - snap["redis"]
                if self.redis is not None and "redis" in snap
                else None
            )
            return
        if "processes" not in snap:
            window.server_cpu = window.server_other_cpu = None
            return
        known: dict[int, str] = snap["processes"]
        ended = {pid: _proc_cpu(pid) for pid in known}  # read first, then look for new ones
        now = self.postgres.processes()
        born = {pid: kind for pid, kind in now.items() if pid not in known}
        ended.update({pid: _proc_cpu(pid) for pid in born})
        ours_cpu = other_cpu = 0.0
        for pid, kind in {**known, **born}.items():
            end = ended.get(pid)
            if end is None:
                continue  # exited during the window: its CPU is lost to us
            delta = end - (snap["pg"].get(pid) or 0.0)
            if kind == "aux":
                other_cpu += delta
            else:
                ours_cpu += delta
        window.server_cpu, window.server_other_cpu = ours_cpu, other_cpu
        window.connections_opened = list(born.values()).count("client")


def drive(
    clients: list[Callable[[str], Any]],
    keys: Callable[[], str],
    meter: Meter,
    *,
    server: str = "postgres",
    seconds: float | None = None,
    count: int | None = None,
    warmup: int = 0,
    warmup_cap: float = 5.0,
    cpus: set[int] | None = None,
) -> Window:
    """One thread per entry of ``clients`` (each its own request function, connections
    already open), sending ``keys()`` requests for ``seconds`` or ``count`` requests each;
    on ``cpus`` only, if given (Linux), else wherever the kernel puts them.

    Each thread first sends ``warmup`` untimed requests (stopping early after
    ``warmup_cap`` seconds), then all wait; the CPU counters are read and the window opens.
    Failed requests (warm-up or timed) are counted in ``errors``, not in ``requests``.
    """
    window = Window()
    lock = threading.Lock()
    ready = threading.Barrier(len(clients) + 1)
    go = threading.Barrier(len(clients) + 1)
    deadline = float("inf")
    setup_errors: list[BaseException] = []

    def client(run: Callable[[str], Any]) -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only
        until = time.perf_counter() + warmup_cap
        errors, first_error, sent, failed = 0, "", 0, 0
        for _ in range(warmup):
            try:
                run(keys())
            except Exception as exc:
                # A transient server error is counted; a client none of whose warm-up
                # requests succeeds stops the benchmark (its system is broken).
                failed += 1
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                if failed == warmup:
                    setup_errors.append(exc)
                    ready.abort()
                    return
            if time.perf_counter() > until:
                break
        try:
            ready.wait()
            go.wait()
        except threading.BrokenBarrierError:
            return
        mine: list[float] = []
        while (now := time.perf_counter()) < deadline and (count is None or sent < count):
            sent += 1
            try:
                run(keys())
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                continue
            mine.append(time.perf_counter() - now)
        with lock:
            window.latencies.extend(mine)
            window.errors += errors
            window.first_error = window.first_error or first_error

    threads = [threading.Thread(target=client, args=(run,), daemon=True) for run in clients]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        go.abort()
        for thread in threads:
            thread.join()
        raise RuntimeError(f"warm-up failed: {setup_errors[0]!r}") from setup_errors[0]
    snap = meter.before(server)
    began = time.perf_counter()
    if seconds is not None:
        deadline = began + seconds
    go.wait()
    for thread in threads:
        thread.join()
    window.seconds = time.perf_counter() - began
    meter.after(snap, window)
    window.requests = len(window.latencies)
    return window


class Progress:
    """A progress bar with an estimate of the time left, on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done = max(total, 1), 0
        self.began = time.perf_counter()

    def show(self, label: str) -> None:
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.began
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        eta = f"{int(left // 60)}:{int(left % 60):02d} left" if self.done else ""
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{eta:>10} {label:<52}"
        )
        sys.stderr.flush()

    def step(self, label: str) -> None:
        self.show(label)
        self.done += 1

    def note(self, text: str) -> None:
        sys.stderr.write(f"\r{text:<110}\n")
        sys.stderr.flush()

    def finish(self) -> None:
        self.done = self.total
        self.show("done")
        sys.stderr.write("\n")
