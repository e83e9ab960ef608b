"""The request path: from :meth:`AsyncEngine.run` (or :meth:`Engine.run`) to the COMMIT that
records a phase. Everything a request runs lives here; the top level keeps what every
layer uses (:mod:`recoverypoint.operation`, :mod:`~recoverypoint.keys`,
:mod:`~recoverypoint.errors`) and the kits built on the engine.

Read it in this order, each module using only those before it:

1. ``_decide``: the pure part, no IO: the registry of operations, the records a claim
   reads, and what a claim or a phase's result decides;
2. ``sql``: every statement of the request path, named after its intent, with the locks it
   takes;
3. ``_libpq``: the sync engine's wire, those statements on libpq (``_libpq_async`` the
   async one's, waited for by ``_waiter`` with the socket registered once per connection);
4. ``_pg_async`` (``_pg``): the SERIALIZABLE transaction, its BEGIN and COMMIT, and the
   retry after a serialization failure;
5. ``phase_guard``: keeping phase code from ending the engine's transaction (``endings``:
   which SQL text ends one);
6. ``context/``: what a phase receives;
7. ``store_async`` (``store``): the statements run in those transactions, by intent;
8. ``heartbeat``: a running foreign step's lease, renewed in the background;
9. ``run_async`` (``run``): :class:`AsyncEngine` (:class:`Engine`), which claims a key and
   runs its phases from the recovery point.

``*_async.py`` (and ``context/atomic_async.py``) are the sources; their sync twins
(``_pg.py``, ``store.py``, ``run.py``, ``context/atomic.py``) are generated from them by
``tools/async_to_sync.py``: edit the async module, then run the tool.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ._decide import ABANDONED_RESPONSE
from .run import Engine

if TYPE_CHECKING:
    from .run_async import AsyncEngine

__all__ = ["ABANDONED_RESPONSE", "AsyncEngine", "Engine"]


def __getattr__(name: str) -> Any:
    # AsyncEngine is imported when first asked for: its module brings SQLAlchemy's asyncio
    # extension and ORM, about a tenth of a second of every process's start, which a sync
    # service, its workers and the commands never use.
    if name == "AsyncEngine":
        from .run_async import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def async_engine_type() -> type[AsyncEngine] | None:
    """:class:`AsyncEngine`, if its module has been imported, else ``None``: no AsyncEngine
    exists before, so what tells the engines apart need not import it."""
    module = sys.modules.get(f"{__name__}.run_async")
    return None if module is None else module.AsyncEngine
