"""The fault points the engine and the enqueuer consult at their boundaries.

They are product, not test code: the engine calls :meth:`Faults.hit` at each boundary
while a fault is armed, and ``RECOVERYPOINT_FAULTS`` arms them for a whole process. Users
reach them through :mod:`recoverypoint.testing`, which documents the points.
"""

from __future__ import annotations

import os
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import psycopg

__all__ = [
    "BOUNDARIES",
    "FAULT_EXIT_STATUS",
    "Effect",
    "Faults",
    "InjectedConflict",
    "InjectedFault",
    "InjectedLostAnswer",
    "faults",
]

Effect = Literal["raise", "exit", "conflict", "lost_answer"]
_EFFECTS: dict[str, Effect] = {
    "raise": "raise",
    "exit": "exit",
    "conflict": "conflict",
    "lost_answer": "lost_answer",
}
# The boundary each effect that stands for a database fault belongs to.
_ONLY_AT = {
    "conflict": ("before_commit", "a serialization failure happens inside a phase's transaction"),
    "lost_answer": ("after_commit", "a COMMIT's answer is lost once the COMMIT went through"),
}
BOUNDARIES = ("before_commit", "after_commit", "before_foreign", "after_foreign", "after_publish")
# The exit status of a process killed by an injected fault, so a supervisor can tell it apart.
FAULT_EXIT_STATUS = 75


class InjectedFault(Exception):
    """Raised at an armed fault point whose effect is ``raise``."""


class InjectedConflict(psycopg.errors.SerializationFailure):
    """Raised at an armed ``before_commit`` point whose effect is ``conflict``: a
    serialization failure (SQLSTATE 40001), which the engine meets as it meets
    PostgreSQL's: it rolls the phase's transaction back and runs the phase again."""


class InjectedLostAnswer(psycopg.OperationalError):
    """Raised at an armed ``after_commit`` point whose effect is ``lost_answer``: the
    COMMIT went through on the server, and the connection dropped before its answer came
    back, as when the network fails right after the COMMIT is sent. The engine meets it as
    any lost connection: an outage (:class:`~recoverypoint.errors.DatabaseUnavailable` to
    its caller), the lease given up, the retry finding the recovery point advanced."""


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
        if effect not in _EFFECTS:
            raise ValueError(
                f"fault effect must be 'raise', 'exit', 'conflict' or 'lost_answer', got {effect!r}"
            )
        only_at = _ONLY_AT.get(effect)
        if only_at is not None and boundary != only_at[0]:
            raise ValueError(
                f"bad fault point {point!r} for {effect}: {only_at[1]}, at {only_at[0]}:<point>"
            )
        with self._lock:
            self._armed[point] = _Armed(probability, effect)
            self.active = True

    def disarm(self) -> None:
        """Switch every fault point off."""
        with self._lock:
            self._armed.clear()
            self.active = self._watcher is not None

    def reseed(self, seed: int | None = None) -> None:
        """Draw from ``seed`` on (from the system's entropy when ``None``)."""
        with self._lock:
            self._random.seed(seed)

    def configure(self, spec: str, effect: Effect = "raise", seed: int | None = None) -> None:
        """Arm the points of ``"point=probability,…"`` (the environment variable's format)."""
        if seed is not None:
            self.reseed(seed)
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
        if effect == "conflict":
            raise InjectedConflict(f"could not serialize access (injected at {point})")
        if effect == "lost_answer":
            raise InjectedLostAnswer(
                f"the connection was lost after COMMIT was sent (injected at {point}): "
                "the COMMIT went through"
            )
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


def arm_from_environment(registry: Faults) -> None:
    """Arm ``registry`` as ``RECOVERYPOINT_FAULTS`` (and its effect and seed) say, and
    nothing else: what it had armed is dropped, its count of faults fired starts at zero,
    and its draws start from a new seed (or the given one). Run for :data:`faults` when
    this module loads; and again in a process forked after the environment changed (the
    demo's, ``recoverypoint.demo.launcher``), which reports only its own faults."""
    registry.disarm()
    registry.fired.clear()
    spec = os.environ.get("RECOVERYPOINT_FAULTS", "")
    name = os.environ.get("RECOVERYPOINT_FAULT_EFFECT", "raise")
    if spec and name not in _EFFECTS:
        raise ValueError(
            f"RECOVERYPOINT_FAULT_EFFECT must be raise, exit, conflict or lost_answer, got {name!r}"
        )
    seed = os.environ.get("RECOVERYPOINT_FAULT_SEED")
    registry.reseed(int(seed) if spec and seed else None)
    if spec:
        registry.configure(spec, _EFFECTS[name])


faults = Faults()
"""The process-wide registry the engine and the enqueuer consult."""
arm_from_environment(faults)
