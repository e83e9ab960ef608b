"""An embedded PostgreSQL (the ``pgserver`` package) for examples and tests without a server."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from .database import normalize_url


@contextmanager
def embedded_database() -> Iterator[str]:
    """Start a throwaway PostgreSQL in a temporary directory; yield its URL; stop it.

    Needs the ``embedded`` extra: ``pip install 'recoverypoint[embedded]'``.
    """
    try:
        with warnings.catch_warnings():
            # pgserver warns on import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as exc:
        raise RuntimeError(
            "no database URL was given and the embedded server is not installed: "
            "pip install 'recoverypoint[embedded]', or pass a PostgreSQL URL"
        ) from exc
    with tempfile.TemporaryDirectory(prefix="recoverypoint-pg-") as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")  # type: ignore[attr-defined]
        try:
            yield normalize_url(server.get_uri()).render_as_string(hide_password=False)
        finally:
            server.cleanup()
