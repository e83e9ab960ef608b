"""Database URLs as users have them, turned into SQLAlchemy engines that run on psycopg 3."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

DATABASE_URL_ENV = "RECOVERYPOINT_DATABASE_URL"
"""Where the commands look for a database URL when none is passed."""

_POSTGRES_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg")


def normalize_url(url: str | URL) -> URL:
    """Return ``url`` with the ``postgresql+psycopg`` driver.

    ``postgres://``, ``postgresql://`` and ``postgresql+psycopg://`` are accepted (the forms
    found in Heroku-style environment variables, libpq and SQLAlchemy docs); any other
    scheme is refused, because recoverypoint relies on PostgreSQL's SERIALIZABLE isolation.
    """
    text = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in _POSTGRES_SCHEMES:
        raise ValueError(
            f"not a PostgreSQL URL: {text.split('@')[-1]!r}; "
            "use postgresql://user:password@host:port/database"
        )
    return make_url(f"postgresql+psycopg://{rest}")


def create_engine(url_or_engine: str | URL | sa.Engine, **kwargs: Any) -> sa.Engine:
    """An engine for ``url_or_engine``; an existing :class:`sqlalchemy.Engine` is returned as is."""
    if isinstance(url_or_engine, sa.Engine):
        return url_or_engine
    return sa.create_engine(normalize_url(url_or_engine), **kwargs)
