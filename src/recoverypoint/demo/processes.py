"""The demo's processes: a supervisor that restarts whatever an injected fault (or anything
else) kills."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..testing import FAULT_EXIT_STATUS
from .launcher import Forked, Launcher

# How long a process that exited for another reason than a fault waits before it is
# started again: it may be failing at start (its database is restarting), and a hot loop
# of restarts would only burn the CPU the rest of the demo needs.
_RESTART_DELAY = 0.5
_POLL = 0.05


@dataclass
class Exits:
    """How a supervised group's processes ended while the demo ran."""

    faults: int = 0
    """Exits by an injected fault (status :data:`FAULT_EXIT_STATUS`)."""
    other: list[int] = field(default_factory=list)
    """Statuses of every other exit, e.g. a start that failed while the database was down."""
    fault_pids: set[int] = field(default_factory=set)
    """The pids that died by a fault: what they had not committed was rolled back."""


class Supervised:
    """``count`` instances of one module run as ``python -m`` would, each forked by
    ``launcher``, and started again whenever it exits, until :meth:`stop`. Their output
    goes to ``log``.

    ``command(start)`` and ``env(start)`` give the module and its arguments, and the extra
    environment, of the ``start``-th start (from 0), so that each start can have a seed of
    its own. Of the descriptors the launcher inherited, they keep ``keep_fds``.
    """

    def __init__(
        self,
        name: str,
        command: Callable[[int], Sequence[str]],
        *,
        launcher: Launcher,
        cwd: Path,
        log: Path,
        env: Callable[[int], dict[str, str]] = lambda start: {},
        count: int = 1,
        keep_fds: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.log = log
        self.exits = Exits()
        self._command = command
        self._env = env
        self._launcher = launcher
        self._cwd = cwd
        self._keep_fds = tuple(keep_fds)
        self._starts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._procs = [self._spawn() for _ in range(count)]
        self._watcher = threading.Thread(target=self._watch, name=f"supervise-{name}", daemon=True)
        self._watcher.start()

    @property
    def restarts(self) -> int:
        return self._starts - len(self._procs)

    def alive(self) -> bool:
        return any(proc.poll() is None for proc in self._procs)

    def _spawn(self) -> Forked:
        start, self._starts = self._starts, self._starts + 1
        module, *args = self._command(start)
        env = {**os.environ, **self._env(start)}
        return self._launcher.start(
            module, args, env=env, cwd=self._cwd, log=self.log, keep_fds=self._keep_fds
        )

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL):
            for index, proc in enumerate(self._procs):
                status = proc.poll()
                if status is None:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    if status == FAULT_EXIT_STATUS:
                        self.exits.faults += 1
                        self.exits.fault_pids.add(proc.pid)
                    else:
                        self.exits.other.append(status)
                        time.sleep(_RESTART_DELAY)
                    self._procs[index] = self._spawn()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every instance (workers finish their batch), SIGKILL the late ones."""
        with self._lock:
            self._stopping.set()
        self._watcher.join()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def python_module(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def wait_until_serving(url: str, group: Supervised, timeout: float = 60.0) -> None:
    """Wait until ``url`` answers HTTP (any status) or fail with the group's log."""
    deadline = time.monotonic() + timeout
    # One client for every try: each new one reads the CA bundle (about 20 ms of CPU).
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                client.get(url)
                return
            except httpx.TransportError:
                time.sleep(0.1)
    raise RuntimeError(
        f"the {group.name} did not start within {timeout:.0f}s; its log ({group.log}) ends:\n"
        + tail(group.log)
    )


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
