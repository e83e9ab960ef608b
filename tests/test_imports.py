"""Every module of the package imports on the Python running the tests: CI runs this on the
oldest supported Python too, where a name from a newer standard library fails at import."""

from __future__ import annotations

import ast
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


def loaded_after(code: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` a new interpreter has loaded after running ``code``."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys\n{code}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({packages!r})))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return ast.literal_eval(done.stdout)


@pytest.mark.slow  # new interpreters, importing recoverypoint
def test_the_command_and_the_pytest_plugin_start_without_alembic() -> None:
    """Alembic costs a command 0.15 s of CPU at start: only migrating imports it (the
    pytest plugin is loaded by every pytest run of a project that installs recoverypoint)."""
    code = "import recoverypoint.cli, recoverypoint.integrations.pytest_plugin"
    assert loaded_after(code, ("alembic",)) == []


@pytest.mark.slow  # new interpreters, importing recoverypoint
def test_a_sync_service_its_workers_and_the_commands_start_without_the_orm() -> None:
    """SQLAlchemy's ORM and asyncio extension cost a process a tenth of a second at start:
    only the async engine, and a phase's ``session``, import them."""
    orm = ("sqlalchemy.orm", "sqlalchemy.ext.asyncio")
    sync = (
        "import recoverypoint as rp, recoverypoint.cli, recoverypoint.context\n"
        "import recoverypoint.integrations.pytest_plugin\n"
        "from recoverypoint.workers import Completer\n"
        "engine = rp.Engine('postgresql://nobody@127.0.0.1:1/none')\n"
        "Completer(engine).engines.runs_async('op', 1)"
    )
    assert loaded_after(sync, orm) == []
    # And the async names are there when asked for.
    assert "sqlalchemy.ext.asyncio" in loaded_after(f"{sync}\nrp.AsyncEngine", orm)
    phases = "from recoverypoint.context import AsyncAtomicContext"
    assert "sqlalchemy.orm" in loaded_after(phases, orm)
