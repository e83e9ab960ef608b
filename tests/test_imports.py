"""Every module of the package imports on the Python running the tests: CI runs this on the
oldest supported Python too, where a name from a newer standard library fails at import."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import recoverypoint

# Programs, not modules: a __main__ runs on import (`python -m recoverypoint`: the CLI), and
# the demo's workers are an application for `recoverypoint worker --app`, read from the
# environment at import (the demo's tests run them).
PROGRAMS = {"recoverypoint.demo.rocket_rides.workers"}

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(recoverypoint.__path__, prefix="recoverypoint.")
    if not info.name.endswith(".__main__") and info.name not in PROGRAMS
)


def test_the_package_has_its_modules() -> None:
    assert {"recoverypoint.engine", "recoverypoint.embedded", "recoverypoint.cli"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_the_module_imports(name: str) -> None:
    importlib.import_module(name)
