"""The engines one set of workers serves: an application's :class:`~recoverypoint.Engine`,
its :class:`~recoverypoint.AsyncEngine`, or both when it has sync and async routes.

The workers' own SQL is sync whichever the engines are (every engine has a sync ``db``);
only the completer's resumes go through the engine that registered the key's operation:
``Engine.resume`` in the worker's thread, ``AsyncEngine.resume`` on an event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, TypeVar, cast

import sqlalchemy as sa

from ..engine import Engine, async_engine_type
from ..errors import OperationNotRegistered
from ..jobs import JobBackend
from ..observe import Observer
from ..operation import Operation

if TYPE_CHECKING:
    from ..engine import AsyncEngine

AnyEngine: TypeAlias = "Engine | AsyncEngine"
"""What a worker takes: either engine, or a sequence of both."""

E = TypeVar("E", "Engine", "AsyncEngine")


def is_engine(value: object) -> TypeGuard[AnyEngine]:
    """Whether ``value`` is an :class:`Engine` or an :class:`AsyncEngine` (the latter's module
    imported only by those who make one)."""
    kind = async_engine_type()
    return isinstance(value, Engine) or (kind is not None and isinstance(value, kind))


class Engines:
    """One application's engines on one database; the first one's observer hears of the
    workers' passes, and the first job backend set is the one the enqueuer publishes to."""

    def __init__(self, engines: AnyEngine | Sequence[AnyEngine], worker: str) -> None:
        given = (engines,) if is_engine(engines) else tuple(cast("Iterable[AnyEngine]", engines))
        if not given:
            raise ValueError(f"{worker}: no engine given")
        for engine in given:
            if not is_engine(engine):
                raise TypeError(
                    f"{worker}: expected a recoverypoint.Engine or AsyncEngine, "
                    f"got {type(engine).__name__}"
                )
        found = tuple(dict.fromkeys(given))  # an engine named twice is one engine
        first = found[0]
        for engine in found[1:]:
            if _place(engine.db) != _place(first.db):
                raise ValueError(
                    f"{worker}: the engines must share one database; "
                    f"{_shown(first.db)} and {_shown(engine.db)} differ"
                )
        self.all: tuple[AnyEngine, ...] = found
        self.first: AnyEngine = first
        seen: dict[tuple[str, int], Operation[Any]] = {}
        for engine in found:
            for operation in engine.operations:
                ident = (operation.name, operation.version)
                if seen.setdefault(ident, operation) is not operation:
                    raise ValueError(
                        f"{worker}: two engines register {ident[0]!r} v{ident[1]}; "
                        "each operation version must have one engine"
                    )

    @property
    def db(self) -> sa.Engine:
        return self.first.db

    @property
    def observer(self) -> Observer:
        return self.first.observer

    @property
    def jobs(self) -> JobBackend | None:
        return next((engine.jobs for engine in self.all if engine.jobs is not None), None)

    @property
    def operations(self) -> tuple[Operation[Any], ...]:
        """Every operation version of every engine (read at each call: an application may
        register more after its workers were made)."""
        return tuple(operation for engine in self.all for operation in engine.operations)

    def owner(self, name: str, version: int, kind: type[E]) -> tuple[E, Operation[Any]]:
        """The engine of ``kind`` that runs operation ``name`` at ``version``, and the
        operation."""
        for engine in self.all:
            if isinstance(engine, kind):
                try:
                    return engine, engine.operation(name, version)
                except OperationNotRegistered:
                    continue
        raise OperationNotRegistered(
            f"operation {name!r} v{version} is not registered with the workers' {kind.__name__}"
        )

    def runs_async(self, name: str, version: int) -> bool:
        """Whether operation ``name`` at ``version`` is an :class:`AsyncEngine`'s."""
        kind = async_engine_type()
        if kind is None:
            return False
        try:
            self.owner(name, version, kind)
        except OperationNotRegistered:
            return False
        return True


def _place(db: sa.Engine) -> tuple[object, ...]:
    """Where ``db`` connects; the driver and credentials may differ between engines."""
    return (db.url.host, db.url.port, db.url.database, db.url.query.get("host"))


def _shown(db: sa.Engine) -> str:
    return db.url.render_as_string(hide_password=True)
