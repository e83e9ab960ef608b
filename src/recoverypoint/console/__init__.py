"""The web console: keys, staged jobs and the audit trail, for people who do not live in
a terminal. Mount it in your own Starlette or FastAPI app::

    from recoverypoint.console import console

    app.mount("/recoverypoint", console(engine, authorize=authorize))

or run it alone: ``recoverypoint console --database-url URL`` (loopback, behind a token).

It reads and acts through :mod:`recoverypoint.admin`, exactly as ``recoverypoint keys``
does: the same queries, the same fenced actions, the same audit table. ``authorize`` is
required (see :mod:`.auth`); scopes, params, phase outputs, stored responses and
fingerprints are masked (:class:`recoverypoint.admin.Mask`) unless it allows ``reveal``
and the visitor asks; every form that changes a key is
CSRF-protected and confirmed on a page that shows what will change.

Needs ``pip install 'recoverypoint[console]'``.
"""

from .app import console
from .auth import ACTIONS, KEY_ACTIONS, REVEAL, VIEW, Authorize
from .hosts import OwnHosts
from .token import TokenLock

__all__ = [
    "ACTIONS",
    "KEY_ACTIONS",
    "REVEAL",
    "VIEW",
    "Authorize",
    "OwnHosts",
    "TokenLock",
    "console",
]
