"""One process that imports the demo's modules once and forks each of the demo's processes
from itself, as a server that preloads its application forks its workers.

A new interpreter spends a second or two importing FastAPI, SQLAlchemy, psycopg and
recoverypoint before it serves anything, and the demo starts its processes again dozens of
times (every injected fault kills one). Forked from a process that already imported them,
a restart costs a fork. Each process is still a process of its own, with its own
connections, killed by its faults (``os._exit``) or by a signal, and its exit status is the
one a process started from scratch would have.

The parent (:class:`Launcher`) and this process (``python -m recoverypoint.demo.launcher``)
speak in lines of JSON over the launcher's standard input and output: a start order (a
module to run as ``python -m`` would, its arguments, its environment, its working folder,
its log and the inherited descriptors it keeps), answered with the new process's pid; a
signal order for one of them, sent by the launcher only while it has not reaped it (so
never to a pid reused since); and, unasked, each process's exit status when it ends. The
launcher ends, killing what it started, when its standard input closes.

What an interpreter reads of its environment only as it starts (``PYTHONPATH``,
``PYTHONHASHSEED``, the other ``PYTHON*`` settings) is the launcher's, not a start's.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from .._faults import arm_from_environment, faults

# What the demo's commands import: the Rocket Rides API and provider, and the workers'
# command line. Not the workers' app module (recoverypoint.demo.rocket_rides.workers),
# which reads its environment when imported: each process imports it after its own is set.
PRELOAD = (
    "fastapi",
    "httpx",
    "uvicorn",
    "sqlalchemy.ext.asyncio",
    "recoverypoint.migrate",
    "recoverypoint.cli",
    "recoverypoint.cli.worker",
    "recoverypoint.demo.rocket_rides.api",
    "recoverypoint.demo.rocket_rides.provider",
    "recoverypoint.demo.rocket_rides.schema",
)
# How often the launcher looks for ended processes while some run.
_POLL = 0.05


class Forked:
    """A process the launcher started: what :class:`subprocess.Popen` offers a supervisor
    (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``), its status told by the launcher."""

    def __init__(self, pid: int, launcher: Launcher) -> None:
        self.pid = pid
        self._launcher = launcher

    def poll(self) -> int | None:
        return self._launcher.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        status = self._launcher.wait(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return status

    def terminate(self) -> None:
        self._launcher.signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        self._launcher.signal(self.pid, signal.SIGKILL)


class Launcher:
    """The parent's side: starts ``python -m recoverypoint.demo.launcher`` in a session of
    its own (a Ctrl-C at the terminal reaches this process, which stops the demo's, not
    them), in the folder of ``log``, which takes its own errors; it inherits ``pass_fds``.
    Forks processes from it (:meth:`start`) until :meth:`close`."""

    def __init__(self, *, log: Path, pass_fds: Sequence[int] = ()) -> None:
        self._log = log.open("ab")
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                cwd=log.parent,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                pass_fds=tuple(pass_fds),
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise
        assert self._process.stdin is not None and self._process.stdout is not None
        self._orders: IO[bytes] = self._process.stdin
        self._answers: IO[bytes] = self._process.stdout
        self._started: queue.Queue[dict[str, Any]] = queue.Queue()
        self._statuses: dict[int, int] = {}
        self._ended = threading.Condition()
        self._ordering = threading.Lock()  # one order at a time: start answers come in order
        self._reader = threading.Thread(target=self._read, name="launcher", daemon=True)
        self._reader.start()

    def start(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log: Path,
        keep_fds: Sequence[int] = (),
    ) -> Forked:
        """Fork a process that runs as ``python -m module args`` would, with ``env`` as its
        whole environment, in ``cwd``, its output appended to ``log``; of the descriptors
        the launcher inherited, it keeps ``keep_fds`` alone."""
        order = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "cwd": str(cwd),
            "log": str(log),
            "keep_fds": list(keep_fds),
        }
        with self._ordering:
            if self._send(order):
                answer = self._started.get()
            else:
                answer = {"error": "it takes no more orders"}
        if "pid" not in answer:
            raise RuntimeError(
                f"the demo's launcher could not start {module}: {answer['error']}; "
                f"its log: {self._log.name}"
            )
        return Forked(answer["pid"], self)

    def signal(self, pid: int, signum: int) -> None:
        """Have the launcher send ``signum`` to ``pid`` if it still runs."""
        if self.status(pid) is None:
            with self._ordering:
                self._send({"signal": signum, "pid": pid})

    def status(self, pid: int) -> int | None:
        with self._ended:
            return self._statuses.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._ended:
            self._ended.wait_for(lambda: pid in self._statuses, timeout)
            return self._statuses.get(pid)

    def close(self) -> None:
        """End the launcher, which kills what it started and is still running."""
        with self._ordering, contextlib.suppress(BrokenPipeError):  # gone already
            self._orders.close()
        self._process.wait()
        self._reader.join()
        self._answers.close()
        self._log.close()

    def _send(self, order: Mapping[str, object]) -> bool:
        try:
            self._orders.write(json.dumps(order).encode() + b"\n")
            self._orders.flush()
        except (OSError, ValueError):  # the launcher is gone, or closed
            return False
        return True

    def _read(self) -> None:
        started: set[int] = set()
        try:
            for line in self._answers:
                answer = json.loads(line)
                if "ended" in answer:
                    with self._ended:
                        self._statuses[answer["ended"]] = answer["status"]
                        self._ended.notify_all()
                else:
                    if "pid" in answer:
                        started.add(answer["pid"])
                    self._started.put(answer)
        finally:
            # The launcher is gone (or spoke nonsense): no start waits for an answer that
            # cannot come, and nothing it started runs on unwatched. Closed, it killed and
            # reported them; killed, it could not: its process group (its session's, which
            # they are in) goes now, and they count as killed.
            status = self._process.wait()
            self._started.put({"error": f"it exited with status {status}"})
            with self._ended:
                if started - self._statuses.keys():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._process.pid, signal.SIGKILL)
                for pid in started - self._statuses.keys():
                    self._statuses[pid] = -signal.SIGKILL
                self._ended.notify_all()


def _serve() -> None:
    """The launcher's loop: orders in, forks and their pids out; ended processes out."""
    for name in PRELOAD:
        importlib.import_module(name)
    # What every forked process shares, and keeps to its end: left out of their garbage
    # collections, which would otherwise walk it in each process and copy each page of it
    # they touch. The imports' own garbage is collected first, not kept in each.
    gc.collect()
    gc.freeze()
    running: set[int] = set()
    pending = b""
    try:
        while True:
            ready, _, _ = select.select([0], [], [], _POLL if running else None)
            if ready:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    _obey(json.loads(line), running)
            while running:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                running.discard(pid)
                _answer({"ended": pid, "status": os.waitstatus_to_exitcode(wait_status)})
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        for pid in running:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            _answer({"ended": pid, "status": status})


def _obey(order: dict[str, Any], running: set[int]) -> None:
    if "signal" in order:
        if order["pid"] in running:  # not reaped: the pid is still that process's
            os.kill(order["pid"], order["signal"])
        return
    try:
        pid = os.fork()
    except OSError as exc:
        _answer({"error": str(exc)})
        return
    if pid == 0:
        _run(order)
    running.add(pid)
    _answer({"pid": pid})


def _answer(answer: Mapping[str, object]) -> None:
    os.write(1, json.dumps(answer).encode() + b"\n")


def _run(order: dict[str, Any]) -> NoReturn:
    """In the forked process: become ``python -m module args`` with its own environment,
    folder and output, then exit with the status that would have had."""
    status = 1
    try:
        # Its output first, so that what goes wrong below is in its log.
        log = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)  # the launcher's answers went there: they stay the launcher's
        os.dup2(log, 2)
        _close_fds_but(order["keep_fds"])
        os.chdir(order["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` puts the folder it starts in
        os.environ.clear()
        os.environ.update(order["env"])
        arm_from_environment(faults)  # the launcher's environment armed it, not this one's
        sys.argv = [order["module"], *order["args"]]
        try:
            runpy.run_module(order["module"], run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                status = exit.code or 0
            else:  # as the interpreter does: the message to standard error, status 1
                print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # What an interpreter does as it exits (logging's flush among the handlers).
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)


def _close_fds_but(keep: Sequence[int]) -> None:
    """Close every descriptor above 2 but ``keep``, as a new process would not have them."""
    low = 3
    for fd in sorted(fd for fd in keep if fd >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


if __name__ == "__main__":
    _serve()
