"""Who may do what: the ``authorize`` callable every console is built with.

It is asked once per request and per action, with the request and the action's name:

- ``view``: see any page (masked);
- ``reveal``: see scopes, params, phase state and stored responses unmasked;
- ``keys.retry``, ``keys.release``, ``keys.abandon``, ``keys.reopen``: change keys.

It returns who the visitor is (a name, written into the audit table) to allow, or
``None`` to refuse; it may be a coroutine function. A viewer is an authorizer that answers
``view`` only. There is no default: a console without one cannot be built.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

VIEW = "view"
REVEAL = "reveal"
KEY_ACTIONS = ("keys.retry", "keys.release", "keys.abandon", "keys.reopen")
ACTIONS = (VIEW, REVEAL, *KEY_ACTIONS)

Authorize = Callable[[Request, str], str | Awaitable[str | None] | None]
"""``authorize(request, action) -> str | None``, or a coroutine function returning that."""


class Forbidden(Exception):
    """The authorizer refused the action: the page says so, and shows nothing else."""


def checked(authorize: object) -> Authorize:
    """``authorize`` if it can be called as one; a console is never built without it."""
    if not callable(authorize):
        raise TypeError(
            "console(engine, authorize=...) needs a callable: authorize(request, action) "
            "returns who the visitor is, or None to refuse"
        )
    return authorize


async def ask(authorize: Authorize, request: Request, action: str) -> str | None:
    """The authorizer's answer. Called in a thread, as a sync one may look a user up;
    an async one only makes its coroutine there, which is awaited here."""
    answer = await run_in_threadpool(authorize, request, action)
    if inspect.isawaitable(answer):
        answer = await answer
    if answer is not None and not (isinstance(answer, str) and answer):
        raise TypeError(f"authorize returned {type(answer).__name__}: a non-empty str or None")
    return answer


async def require(authorize: Authorize, request: Request, action: str) -> str:
    """Who the visitor is, if ``action`` is allowed; else :class:`Forbidden`."""
    who = await ask(authorize, request, action)
    if who is None:
        raise Forbidden(action)
    return who


async def granted(authorize: Authorize, request: Request, actions: tuple[str, ...]) -> set[str]:
    """Which of ``actions`` the visitor may take: what the page offers them."""
    return {action for action in actions if await ask(authorize, request, action) is not None}
