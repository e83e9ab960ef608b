"""``--app module:attr``: the application's :class:`~recoverypoint.Engine` or
:class:`~recoverypoint.AsyncEngine`, named as ``uvicorn`` and ``celery -A`` name an
application; given twice, an application's two engines (sync and async routes)."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..engine import Engine
from ..workers.engines import AnyEngine, Engines, is_engine


class UsageError(Exception):
    """Bad arguments or a bad ``--app``: exit status 2."""


def load_engines(specs: Sequence[str]) -> Engines:
    """The engines named by ``--app`` options, on one database."""
    try:
        return Engines([load_engine(spec) for spec in specs], "--app")
    except ValueError as exc:  # two databases, or one operation version on both engines
        raise UsageError(str(exc)) from exc


def load_engine(spec: str) -> AnyEngine:
    """The :class:`Engine` or :class:`AsyncEngine` named by ``module:attr`` (``attr`` may
    be dotted)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--app must be MODULE:ATTR, e.g. myapp.jobs:engine; got {spec!r}")
    if module_name.startswith("."):  # relative to nothing: importlib raises TypeError
        raise UsageError(f"--app {spec}: MODULE must be absolute, e.g. myapp.jobs")
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
    if not is_engine(target):
        raise UsageError(
            f"--app {spec}: expected a recoverypoint.Engine or AsyncEngine, "
            f"got {type(target).__name__}"
        )
    return target


def dispose(engines: Engines) -> None:
    """Close the engines' pools, an :class:`AsyncEngine`'s on an event loop of its own."""
    for engine in engines.all:
        if isinstance(engine, Engine):
            engine.dispose()
        else:
            asyncio.run(engine.dispose())
