"""Fault injection at the engine's boundaries, for recoverypoint's tests and for yours.

A fault point is named ``<boundary>:<name>``:

==========================  ===========================================================
``before_commit:<point>``   an atomic phase ran; its transaction has not committed
``after_commit:<point>``    the phase (or a step's result) committed; nothing else ran
``before_foreign:<point>``  a foreign step is about to be called
``after_foreign:<point>``   the foreign step returned; its result is not yet committed
``after_publish:<job>``     the enqueuer published a job; its row is not yet deleted
==========================  ===========================================================

``<name>`` may be ``*`` for every point of that boundary. Each armed point fires with a
probability, and its effect is an exception (:class:`InjectedFault`) or an abrupt process
exit (``os._exit``, what SIGKILL or a power cut leaves behind: no ``finally``, no rollback
sent, the database sees the connection drop).

Switch faults on in code::

    from recoverypoint.testing import faults
    faults.arm("after_commit:ride_created", probability=1.0, effect="raise")

or for a whole process through the environment::

    RECOVERYPOINT_FAULTS="after_commit:ride_created=0.2,before_foreign:charge_created=0.1"
    RECOVERYPOINT_FAULT_EFFECT=exit      # or raise (the default)
    RECOVERYPOINT_FAULT_SEED=42          # repeatable runs

Faults are off by default; when off, each boundary costs one attribute read. Under pytest,
the ``rp_faults`` fixture (:mod:`recoverypoint.integrations.pytest_plugin`) is this
registry, disarmed before and after each test.

:func:`temporary_database` gives a test (or a demo run) an empty database of its own on a
server you run, and drops it afterwards.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.pool import NullPool

from .database import create_engine, normalize_url

Effect = Literal["raise", "exit"]
BOUNDARIES = ("before_commit", "after_commit", "before_foreign", "after_foreign", "after_publish")
# The exit status of a process killed by an injected fault, so a supervisor can tell it apart.
FAULT_EXIT_STATUS = 75


class InjectedFault(Exception):
    """Raised at an armed fault point whose effect is ``raise``."""


@dataclass(frozen=True)
class _Armed:
    probability: float
    effect: Effect


class Faults:
    """The registry of armed fault points; :data:`faults` is the process-wide one."""

    def __init__(self, seed: int | None = None) -> None:
        self.active = False
        self._armed: dict[str, _Armed] = {}
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.fired: Counter[str] = Counter()
        # Decides at every boundary while set (see watching): how explore() crashes a run.
        self._watcher: Callable[[str], Effect | None] | None = None

    def arm(self, point: str, probability: float = 1.0, effect: Effect = "raise") -> None:
        """Make ``point`` fire with ``probability``."""
        boundary, sep, name = point.partition(":")
        if not sep or not name or boundary not in BOUNDARIES:
            raise ValueError(
                f"bad fault point {point!r}: use <boundary>:<name> with a boundary in "
                f"{', '.join(BOUNDARIES)} and a name or *"
            )
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"fault probability must be within 0..1, got {probability}")
        if effect not in ("raise", "exit"):
            raise ValueError(f"fault effect must be 'raise' or 'exit', got {effect!r}")
        with self._lock:
            self._armed[point] = _Armed(probability, effect)
            self.active = True

    def disarm(self) -> None:
        """Switch every fault point off."""
        with self._lock:
            self._armed.clear()
            self.active = self._watcher is not None

    def configure(self, spec: str, effect: Effect = "raise", seed: int | None = None) -> None:
        """Arm the points of ``"point=probability,…"`` (the environment variable's format)."""
        if seed is not None:
            self._random.seed(seed)
        for item in filter(None, (part.strip() for part in spec.split(","))):
            point, _, probability = item.rpartition("=")
            try:
                self.arm(point, float(probability), effect)
            except ValueError as exc:
                raise ValueError(f"RECOVERYPOINT_FAULTS: {exc}") from None

    def hit(self, boundary: str, name: str) -> None:
        """Called by the engine at each boundary; fires when an armed point says so."""
        point = f"{boundary}:{name}"
        with self._lock:
            watcher = self._watcher
        effect = watcher(point) if watcher is not None else None
        if effect is None:
            with self._lock:
                armed = self._armed.get(point) or self._armed.get(f"{boundary}:*")
                if armed is None or self._random.random() >= armed.probability:
                    return
                effect = armed.effect
        with self._lock:
            self.fired[point] += 1
        if effect == "exit":
            sys.stderr.write(f"recoverypoint: injected fault {boundary}:{name}, exiting\n")
            sys.stderr.flush()
            os._exit(FAULT_EXIT_STATUS)
        raise InjectedFault(f"{boundary}:{name}")

    @contextmanager
    def injected(
        self, point: str, probability: float = 1.0, effect: Effect = "raise"
    ) -> Iterator[Faults]:
        """Arm ``point`` for the duration of a ``with`` block."""
        self.arm(point, probability, effect)
        try:
            yield self
        finally:
            with self._lock:
                self._armed.pop(point, None)
                self.active = bool(self._armed) or self._watcher is not None

    @contextmanager
    def watching(self, watcher: Callable[[str], Effect | None]) -> Iterator[Faults]:
        """Call ``watcher(point)`` at every boundary for the duration of a ``with`` block;
        the effect it returns fires there, ``None`` lets the run go on."""
        with self._lock:
            self._watcher = watcher
            self.active = True
        try:
            yield self
        finally:
            with self._lock:
                self._watcher = None
                self.active = bool(self._armed)


def _from_environment() -> Faults:
    registry = Faults()
    spec = os.environ.get("RECOVERYPOINT_FAULTS", "")
    if spec:
        name = os.environ.get("RECOVERYPOINT_FAULT_EFFECT", "raise")
        effects: dict[str, Effect] = {"raise": "raise", "exit": "exit"}
        if name not in effects:
            raise ValueError(f"RECOVERYPOINT_FAULT_EFFECT must be raise or exit, got {name!r}")
        seed = os.environ.get("RECOVERYPOINT_FAULT_SEED")
        registry.configure(spec, effects[name], int(seed) if seed else None)
    return registry


faults = _from_environment()
"""The process-wide registry the engine and the enqueuer consult."""


@contextmanager
def temporary_database(server_url: str, prefix: str = "rp_test") -> Iterator[str]:
    """Create an empty database ``<prefix>_<hex>`` on the server of ``server_url``, yield
    its URL (``postgresql+psycopg://``, password included), and drop it at the end.

    The database named in ``server_url`` is only used to create and drop the new one, so
    ``…/postgres`` will do; the role needs the CREATEDB privilege.
    """
    url = normalize_url(server_url)
    name = f"{prefix}_{secrets.token_hex(8)}"
    # CREATE/DROP DATABASE cannot run inside a transaction.
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                # FORCE: connections left behind (a killed process's) must not keep it.
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()
