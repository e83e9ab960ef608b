"""Every module of the package imports on the Python running the tests: CI runs this on the
oldest supported Python too, where a name from a newer standard library fails at import."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

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


# drf-spectacular reads Django's settings as it is imported, and so does the module that
# extends it: imported, as in a Django project, once the settings are (the test site's).
NEEDS_DJANGO_SETTINGS = {"recoverypoint.integrations.django._spectacular"}


@pytest.mark.parametrize("name", MODULES)
def test_the_module_imports(name: str) -> None:
    if name in NEEDS_DJANGO_SETTINGS:
        from django.conf import settings
        from django_site import settings as site

        if not settings.configured:
            settings.configure(**{key: getattr(site, key) for key in dir(site) if key.isupper()})
    importlib.import_module(name)


def test_the_command_and_the_pytest_plugin_start_without_alembic() -> None:
    """Alembic costs a command 0.15 s of CPU at start: only migrating imports it (the
    pytest plugin is loaded by every pytest run of a project that installs recoverypoint)."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, recoverypoint.cli, recoverypoint.integrations.pytest_plugin\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout == "[]\n", loaded.stdout
