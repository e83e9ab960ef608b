"""What every phase receives, sync or async alike, and none of it does IO: the keys a
phase derives, the jobs an atomic phase stages, and a foreign step's whole context."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol

from ...keys import canonical_json, derived_key_of, downstream_key_of, record_material
from ...observe import NO_OBSERVER, Observer


class KeyIdentity:
    """The stored fields every derived key is built from (the record's seed, or for a
    record claimed before seeds existed its id and creation time, and its generation); what
    the keys share is made once per run."""

    __slots__ = ("_material", "created_at", "key_id", "operation")

    operation: str
    key_id: int
    created_at: datetime
    _material: str

    def __init__(
        self,
        operation: str,
        key_id: int,
        created_at: datetime,
        seed: str | None,
        generation: int = 0,
    ) -> None:
        set_once = object.__setattr__  # read-only after: the material is made from them
        set_once(self, "operation", operation)
        set_once(self, "key_id", key_id)
        set_once(self, "created_at", created_at)
        material = record_material(seed, key_id, created_at, operation, generation)
        set_once(self, "_material", material)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a KeyIdentity is read-only: {name} cannot change")

    def derive(self, kind: str, *names: str) -> str:
        """:func:`~recoverypoint.keys.derived_key_of` this record's material."""
        return derived_key_of(self._material, kind, *names)

    def downstream_key(self, point: str, name: str, renewals: int) -> str:
        """:func:`~recoverypoint.keys.downstream_key_of` this record's material."""
        return downstream_key_of(self._material, point, name, renewals)


@dataclass(frozen=True)
class StagedJob:
    name: str
    args_json: str
    job_key: str
    trace_context: str | None = None
    """The W3C traceparent of the phase that staged it, when an observer traces."""


class Staging:
    """The state and staged jobs of an atomic phase; its transaction comes with
    :class:`~recoverypoint.AtomicContext` or :class:`~recoverypoint.AsyncAtomicContext`.

    Attributes
    ----------
    state:
        A mutable dict persisted with the recovery point: what later phases need to know.
    key_id:
        The key record's id, for linking business rows to the request.
    recovery_point:
        In an operation's compensation: the last recovery point the abandoned key
        committed, which tells the phases whose effects are to be undone. ``None`` in a
        phase.
    """

    recovery_point: str | None = None

    def __init__(
        self,
        state: dict[str, Any],
        identity: KeyIdentity,
        point: str,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self._observer = observer
        self.state = state
        self.key_id = identity.key_id
        self._identity = identity
        self._point = point
        self.staged_jobs: list[StagedJob] = []

    def stage_job(self, name: str, args: Mapping[str, Any] | None = None) -> str:
        """Stage a job in this phase's transaction; the enqueuer publishes it after commit.

        Returns the job's ``job_key``, stable across retries, for the consumer to dedupe on.
        """
        if not name:
            raise ValueError("a job needs a name")
        try:
            args_json = canonical_json(dict(args or {}))
        except ValueError as exc:
            raise ValueError(f"the args of job {name!r} are {exc}") from exc
        job_key = self._identity.derive("job", self._point, str(len(self.staged_jobs)), name)
        trace_context = self._observer.trace_context()  # the consumer's trace links here
        self.staged_jobs.append(StagedJob(name, args_json, job_key, trace_context))
        return job_key


class Lease(Protocol):
    """A running step's lease, as its heartbeat keeps it (:mod:`recoverypoint.engine.heartbeat`)."""

    @property
    def lost(self) -> bool: ...


class StepContext:
    """Handed to a foreign step, which runs outside any transaction.

    Attributes
    ----------
    state:
        A read-only view of what earlier phases committed.
    key_id:
        The key record's id.
    renewals:
        How many times the step was called anew past its provider's dedupe window (see
        ``Operation.foreign_step``); 0 until then.
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        identity: KeyIdentity,
        point: str,
        lease: Lease,
        renewals: int = 0,
    ) -> None:
        self.state: Mapping[str, Any] = MappingProxyType(dict(state))
        self.key_id = identity.key_id
        self.renewals = renewals
        self._identity = identity
        self._point = point
        self._lease = lease

    @property
    def lease_lost(self) -> bool:
        """Whether this attempt may have lost the key to another while the step runs.

        The attempt renews its lease in the background while the step runs, so a live
        step keeps its key however long it takes. This turns ``True`` once a renewal found
        the lease gone (an operator's ``recoverypoint keys release --force``; another
        attempt may have taken the key), or once the last renewal that succeeded is older
        than the operation's ``lock_timeout`` on this process's monotonic clock (the
        database away; :class:`recoverypoint.testing.Clock` does not move it): another
        attempt may be running this step now, and this one's next commit fails with
        :class:`~recoverypoint.LockLost`, whatever the step returns. A step that makes
        several calls may check it between them and stop early (raise, and let the attempt
        that holds the key carry on).
        """
        return self._lease.lost

    def downstream_key(self, name: str | None = None) -> str:
        """The idempotency key to hand the foreign system for this step.

        The same for every attempt at this step of this request, different for every other
        step and request, at most 67 characters, and free of the scope and the client's key.
        Pass ``name`` when one step makes several foreign calls. A step called anew after
        its provider forgot the old key (:attr:`renewals`) gets a fresh one.
        """
        return self._identity.downstream_key(self._point, name or "", self.renewals)
