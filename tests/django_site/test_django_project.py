"""docs/how-to/django.md from a shell: a Django project made from scratch (``django-admin
startproject``), the page's modules written to the files their first lines name, and its
shell lines run as processes of their own, as a deploy runs them. Nothing is imported into
the process that runs the worker but what Django and the command import themselves, so a
worker that does not find the project's operations leaves the key unfinished here."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from workload import plant_keys

from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # a Django project's commands as subprocesses

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "how-to" / "django.md"
RIDES = ROOT / "examples" / "django_rides" / "rides"  # the models the page's rides app has

# The provider the page's myproject.payments names: one charge per idempotency key, each
# written to charges.log; down while $PAYMENTS_DOWN is set.
PAYMENTS = """
import os
from pathlib import Path

LOG = Path(__file__).resolve().parents[1] / "charges.log"


class Payments:
    def charge(self, amount, *, idempotency_key):
        if os.environ.get("PAYMENTS_DOWN"):
            raise ConnectionError("the provider is down")
        with LOG.open("a") as log:
            log.write(idempotency_key + "\\n")
        return "ch_" + idempotency_key[-8:]


payments = Payments()
"""

# What a project adds to the settings startproject wrote: the page's apps, and PostgreSQL.
SETTINGS = """
import os

from sqlalchemy.engine import make_url

INSTALLED_APPS += [
    "rest_framework",
    "rest_framework.authtoken",
    "recoverypoint.integrations.django",
    "orders",
    "rides",
]
_url = make_url(os.environ["PROJECT_DATABASE_URL"])
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
    }
}
# The receipt on the worker's output: startproject writes that mailer itself from Django 6.1
# on (MAILERS); before, a project is on SMTP unless it says otherwise.
if "MAILERS" not in globals():
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
"""

# A client books a ride while the provider is down: the key stops after its first phase.
BOOK = """
from django.contrib.auth.models import User

from myproject.idempotency import engine
from rides.idempotency import rides

user = User.objects.create_user("rider", email="rider@example.com")
params = {"user_id": user.pk, "origin": "Montreal", "target": "Quebec"}
try:
    engine.run(rides, key="ride-1", params=params, scope=str(user.pk))
except ConnectionError:
    pass
"""


def make_project(directory: Path) -> None:
    """``django-admin startproject myproject``, then the page's modules and apps."""
    run([sys.executable, "-m", "django", "startproject", "myproject", str(directory)], directory)
    page = PAGE.read_text()
    for block in re.findall(r"```python\n(.*?)```", page, re.S):
        path = re.fullmatch(r"# (\w+)/(\w+)\.py", block.splitlines()[0])
        assert path, f"a block names its file first: {block.splitlines()[0]!r}"
        package = directory / path[1]
        package.mkdir(exist_ok=True)
        (package / "__init__.py").touch()
        (package / f"{path[2]}.py").write_text(block)
    shutil.copy(RIDES / "models.py", directory / "rides" / "models.py")
    shutil.copytree(RIDES / "migrations", directory / "rides" / "migrations")
    (directory / "myproject" / "payments.py").write_text(PAYMENTS)
    with (directory / "myproject" / "settings.py").open("a") as settings:
        settings.write(SETTINGS)


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd``, as a shell there runs it: no settings module, no database
    URL but the project's own."""
    clean = {
        name: value
        for name, value in os.environ.items()
        if name not in ("DJANGO_SETTINGS_MODULE", "RECOVERYPOINT_DATABASE_URL", "PYTHONPATH")
    }
    return subprocess.run(
        command, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_page_s_worker_command_finishes_a_key_from_a_shell(
    tmp_path: Path, server_url: str
) -> None:
    make_project(tmp_path)
    [shell] = re.findall(r"```shell\n(.*?)```", PAGE.read_text(), re.S)
    lines = [shlex.split(line.split("#")[0]) for line in shell.splitlines()]
    assert all(line[:2] == ["python", "manage.py"] for line in lines)
    *setup, [*worker] = lines
    assert worker[2:4] == ["recoverypoint", "worker"]

    with temporary_database(server_url, "rp_django_project") as url:
        env = {"PROJECT_DATABASE_URL": url}
        for line in setup:
            done = run([sys.executable, *line[1:]], tmp_path, **env)
            assert done.returncode == 0, done.stderr
        booked = run(
            [sys.executable, "manage.py", "shell", "-c", BOOK], tmp_path, PAYMENTS_DOWN="1", **env
        )
        assert booked.returncode == 0, booked.stderr
        db = create_engine(url, poolclass=NullPool)
        try:
            with db.begin() as conn:  # its backoff waited out, as `keys retry` does
                conn.execute(sa.text("UPDATE idempotency_keys SET next_attempt_at = now()"))
            # A single-step view's request whose client never came back: the view's module
            # registers its operation, which only the URLconf imports.
            [view_key] = plant_keys(db, "create_order", 1)

            # One pass, rather than until stopped; its client's retry is not awaited.
            done = run([sys.executable, *worker[1:], "--once", "--min-age", "0"], tmp_path, **env)

            assert done.returncode == 0, done.stderr
            with db.connect() as conn:
                key = conn.execute(
                    sa.text(
                        "SELECT recovery_point, response_status FROM idempotency_keys "
                        "WHERE operation = 'create_ride'"
                    )
                ).one()
                view_attempts = conn.execute(
                    sa.text("SELECT attempts FROM idempotency_keys WHERE id = :id"),
                    {"id": view_key},
                ).scalar_one()
                ride = conn.execute(sa.text("SELECT charge_id FROM rides_ride")).one()
        finally:
            db.dispose()
    assert tuple(key) == ("finished", 201), done.stderr
    # The completer knew the view's operation: it tried the key (only its client can finish
    # it), rather than report it as no worker's.
    assert view_attempts == 1 and "event=unfinishable" not in done.stderr
    charges = (tmp_path / "charges.log").read_text().split()
    assert len(charges) == 1 and ride.charge_id == f"ch_{charges[0][-8:]}"
    # The enqueuer published the receipt the last phase staged: Django's console mailer.
    assert "Subject: Your ride" in done.stdout and "To: rider@example.com" in done.stdout


def test_migrate_runs_while_the_urlconf_cannot_be_imported_nor_an_operations_module(
    tmp_path: Path, server_url: str
) -> None:
    make_project(tmp_path)
    (tmp_path / "myproject" / "urls.py").write_text("raise ImportError('a view not deployed')\n")
    # An `operations` module (a name many apps use, Django's own among them) is not looked
    # for as Django starts: only `idempotency` modules are.
    (tmp_path / "rides" / "operations.py").write_text("raise ImportError('not ours')\n")
    command = [sys.executable, "manage.py", "recoverypoint"]

    with temporary_database(server_url, "rp_django_urlconf") as url:
        env = {"PROJECT_DATABASE_URL": url}
        migrated = run([*command, "migrate"], tmp_path, **env)
        db = create_engine(url, poolclass=NullPool)
        try:
            with db.connect() as conn:
                tables = conn.execute(sa.text("SELECT to_regclass('idempotency_keys')")).scalar()
        finally:
            db.dispose()
        # The worker needs the views' operations: it stops on the URLconf's error.
        worker = run(
            [*command, "worker", "reaper", "--once", "--app", "myproject.idempotency:engine"],
            tmp_path,
            **env,
        )

    assert migrated.returncode == 0, migrated.stderr
    assert tables == "idempotency_keys"
    assert worker.returncode != 0 and "a view not deployed" in worker.stderr
