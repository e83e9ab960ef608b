"""``--app module:attr``: the application's :class:`~recoverypoint.Engine`, named as
``uvicorn`` and ``celery -A`` name an application."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ..engine import Engine


class UsageError(Exception):
    """Bad arguments or a bad ``--app``: exit status 2."""


def load_engine(spec: str) -> Engine:
    """The :class:`Engine` named by ``module:attr`` (``attr`` may be dotted)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--app must be MODULE:ATTR, e.g. myapp.jobs:engine; got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--app {spec}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"--app {spec}: {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(target, Engine):
        raise UsageError(
            f"--app {spec}: expected a recoverypoint.Engine, got {type(target).__name__}"
        )
    return target
