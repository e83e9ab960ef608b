"""Starlette's TestClient, imported without the warning that Starlette's newer releases give
when httpx (not httpx2) is installed under it; the older ones the floors run have none."""

from __future__ import annotations

import warnings

import starlette.exceptions

DEPRECATION = getattr(starlette.exceptions, "StarletteDeprecationWarning", DeprecationWarning)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DEPRECATION)
    from starlette.testclient import TestClient

__all__ = ["DEPRECATION", "TestClient"]
