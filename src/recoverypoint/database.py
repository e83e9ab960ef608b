"""Database URLs as users have them, turned into SQLAlchemy engines that run on psycopg 3."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

DATABASE_URL_ENV = "RECOVERYPOINT_DATABASE_URL"
"""Where the commands look for a database URL when none is passed."""

_POSTGRES_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg")
# A URL's scheme as RFC 3986 spells it; nothing else before "://" is quoted in an error.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def normalize_url(url: str | URL) -> URL:
    """Return ``url`` with the ``postgresql+psycopg`` driver.

    ``postgres://``, ``postgresql://`` and ``postgresql+psycopg://`` are accepted (the forms
    found in Heroku-style environment variables, libpq and SQLAlchemy docs); any other
    scheme is refused, because recoverypoint relies on PostgreSQL's SERIALIZABLE isolation.

    libpq's list of hosts (``postgresql://u@h1:5432,h2:5433/db?target_session_attrs=
    read-write``: the way to point an application at a primary that moves) is written the
    way SQLAlchemy reads one (``?host=h1,h2&port=5432,5433``); libpq tries them in order,
    and ``target_session_attrs`` picks the primary among them.
    """
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    scheme, sep, rest = text.partition("://")
    if not sep or _SCHEME.fullmatch(scheme) is None:
        # No scheme to name: what precedes "://" (if anything does) may be a password.
        raise ValueError(
            "the database URL does not start with a scheme; "
            "write postgresql://user:password@host:port/database"
        )
    if scheme not in _POSTGRES_SCHEMES:
        raise ValueError(
            f"{scheme}://… is not a PostgreSQL URL: the scheme is {scheme!r}; "
            "use postgresql:// or postgres://"
        )
    return make_url(f"postgresql+psycopg://{_hosts_in_query(rest)}")


# The part after the scheme, when it names several hosts: user@h1[:p1],h2[:p2]/db?query.
# A password with "/", "?" or "@" is percent-encoded in such a URL, as libpq requires.
_HOST_LIST = re.compile(
    r"(?P<user>[^@/?]*@)?(?P<hosts>[^/?@]*,[^/?@]*)(?P<path>/[^?]*)?(?:\?(?P<query>.*))?", re.S
)
# One host of the list: a name or an IPv4 address, or an IPv6 address in brackets; a port.
_HOST = re.compile(r"(?:\[(?P<ipv6>[^\]]*)\]|(?P<name>[^:\[\]]*))(?::(?P<port>[0-9]*))?")


def _hosts_in_query(rest: str) -> str:
    """``rest`` with a list of hosts moved into its query, the form SQLAlchemy reads."""
    found = _HOST_LIST.fullmatch(rest)
    if found is None:
        return rest
    hosts: list[str] = []
    ports: list[str] = []
    for entry in found["hosts"].split(","):
        host = _HOST.fullmatch(entry)
        if host is None or not (host["ipv6"] or host["name"]):
            raise ValueError(f"not a host[:port] in the URL's list of hosts: {entry!r}")
        hosts.append(host["ipv6"] or host["name"])
        ports.append(host["port"] or "")  # empty: libpq's default port
    query = parse_qsl(found["query"] or "", keep_blank_values=True)
    if any(name in ("host", "port") for name, _ in query):
        raise ValueError("name the hosts either before the database or as ?host=, not both")
    query.append(("host", ",".join(hosts)))
    if any(ports):
        query.append(("port", ",".join(ports)))
    return f"{found['user'] or ''}{found['path'] or '/'}?{urlencode(query, safe=',:')}"


POOL_ORDER = {"pool_use_lifo": True}
"""How recoverypoint's own pools hand out connections: the one given back last first. A
pool larger than the requests in flight then keeps a few connections and their server
processes busy and the rest idle, instead of taking turns with all of them, which costs
the server (benchmarks/README.md, "The pool's order"). An application's own engine is
configured by the application (docs/how-to/production.md)."""


def create_engine(url_or_engine: str | URL | sa.Engine, **kwargs: Any) -> sa.Engine:
    """An engine for ``url_or_engine``; an existing :class:`sqlalchemy.Engine` is returned as is.
    Its pool hands out the connection given back last (:data:`POOL_ORDER`), unless
    ``poolclass`` or ``pool`` is passed."""
    if isinstance(url_or_engine, sa.Engine):
        return url_or_engine
    # A pool of another class (NullPool, StaticPool) or one made already takes no order:
    # SQLAlchemy refuses the argument there.
    if "poolclass" not in kwargs and "pool" not in kwargs:
        kwargs = {**POOL_ORDER, **kwargs}
    return sa.create_engine(normalize_url(url_or_engine), **kwargs)
