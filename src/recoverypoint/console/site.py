"""What every page of one console shares: the admin layer it reads and acts through, the
authorizer, and the visitor it makes of each request; and how a page's failure becomes
an error page that says what went wrong without leaking how (no SQL, no traceback)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from starlette.requests import Request
from starlette.responses import Response

from ..admin import Admin, NotFound, Refused
from .auth import KEY_ACTIONS, REVEAL, VIEW, Authorize, Forbidden, granted, require
from .csrf import CsrfFailed
from .forms import FormError
from .render import problem

logger = logging.getLogger("recoverypoint.console")

REVEAL_COOKIE = "rp_console_reveal"


@dataclass(frozen=True)
class Visitor:
    name: str
    """Who the authorizer said the visitor is: the audit table's actor."""
    may: frozenset[str]
    """The actions beyond ``view`` the visitor may take."""
    reveal: bool
    """Whether this page shows scopes and params unmasked (allowed, and asked for)."""

    @property
    def operator(self) -> bool:
        return bool(self.may & set(KEY_ACTIONS))


@dataclass(frozen=True)
class Site:
    admin: Admin
    authorize: Authorize

    async def visitor(self, request: Request) -> Visitor:
        """Who is asking, if they may look at all (else :class:`Forbidden`)."""
        name = await require(self.authorize, request, VIEW)
        may = frozenset(await granted(self.authorize, request, (REVEAL, *KEY_ACTIONS)))
        asked = request.cookies.get(REVEAL_COOKIE) == "1"
        visitor = Visitor(name, may, reveal=asked and REVEAL in may)
        request.state.visitor = visitor
        return visitor

    def acting(self, visitor: Visitor) -> Admin:
        """The admin layer, acting as the visitor, through the console (for the audit)."""
        return dataclasses.replace(self.admin, actor=visitor.name, via="console")


Page = Callable[[Site, Request], Awaitable[Response]]


def guarded(handler: Page) -> Page:
    """``handler`` with each failure turned into its page."""

    @functools.wraps(handler)
    async def run(site: Site, request: Request) -> Response:
        try:
            return await handler(site, request)
        except Forbidden:
            return problem(request, 403, "Not allowed", "You may not do this here.")
        except CsrfFailed as exc:
            return problem(request, 403, "Refused", str(exc))
        except FormError as exc:
            return problem(request, 400, "Bad request", str(exc))
        except NotFound as exc:
            return problem(request, 404, "Not found", str(exc))
        except Refused as exc:
            return problem(request, 409, "Nothing was done", str(exc))
        except (DBAPIError, SQLAlchemyError):
            incident = _incident(request)
            return problem(
                request,
                503,
                "The database did not answer",
                f"Try again in a moment. Reference {incident}.",
            )
        except Exception:
            incident = _incident(request)
            return problem(request, 500, "Something went wrong", f"It was logged as {incident}.")

    return run


def _incident(request: Request) -> str:
    """Log the failure in full, for the operator's logs only; the page gets its id."""
    incident = secrets.token_hex(4)
    logger.exception("console page failed: incident=%s path=%s", incident, request.url.path)
    return incident
