"""``manage.py recoverypoint ...``: the ``recoverypoint`` command, with Django set up.

The same subcommands and options (``worker``, ``migrate``, ``keys``, ``jobs``, ``doctor``...),
so that the workers resume phases that use the ORM and import the project's models.
The operations they know are every installed app's (registered in its ``idempotency``
module, which the app imports once Django is ready: :mod:`..apps`) and those of the
single-step views the URLconf imports. The URLconf is imported only for the subcommands
that use the operations (``worker``, and any given ``--app``), so that ``migrate`` runs
whether or not the project's views import. Without ``--database-url`` (or
``$RECOVERYPOINT_DATABASE_URL``) the database is Django's ``DATABASES["default"]``;
``--using ALIAS``, first, names another::

    python manage.py recoverypoint migrate
    python manage.py recoverypoint worker --app myproject.idempotency:engine
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from django.conf import settings  # type: ignore[import-untyped]
from django.core.management.base import BaseCommand  # type: ignore[import-untyped]
from django.db import connections  # type: ignore[import-untyped]
from django.urls import get_resolver  # type: ignore[import-untyped]
from sqlalchemy.engine import URL

from ..... import cli
from .....database import DATABASE_URL_ENV


class Command(BaseCommand):  # type: ignore[misc]
    help = "recoverypoint's command (worker, migrate, keys, jobs, doctor...) on Django's database"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> NoReturn:
        # The arguments are the recoverypoint command's, Django's own options included.
        sys.exit(run(argv[2:]))

    def handle(self, *args: str, **options: Any) -> None:
        status = run(list(args))
        if status:
            raise SystemExit(status)


def run(argv: list[str]) -> int:
    """The recoverypoint command with ``argv``, on Django's database unless told another."""
    using = "default"
    if argv[:1] == ["--using"] and len(argv) > 1:
        using, argv = argv[1], argv[2:]
    if getattr(settings, "ROOT_URLCONF", None) and _uses_operations(argv):
        # A single-step view's operation is registered as its module is imported: the
        # URLconf imports them, as a request would.
        get_resolver().url_patterns  # noqa: B018
    before = os.environ.get(DATABASE_URL_ENV)
    if before is None:
        os.environ[DATABASE_URL_ENV] = database_url(using)
    try:
        return cli.main(argv)
    finally:
        if before is None:
            os.environ.pop(DATABASE_URL_ENV, None)


def _uses_operations(argv: list[str]) -> bool:
    """Whether the subcommand ``argv`` runs is given the project's operations: the
    workers', and any other's told an engine with ``--app``."""
    return argv[:1] == ["worker"] or any(arg == "--app" or arg.startswith("--app=") for arg in argv)


def database_url(using: str = "default") -> str:
    """Django's database ``using`` as a URL, password included."""
    database = connections[using].settings_dict
    port = database.get("PORT")
    return URL.create(
        "postgresql+psycopg",
        username=database.get("USER") or None,
        password=database.get("PASSWORD") or None,
        host=database.get("HOST") or None,
        port=int(port) if port else None,
        database=database.get("NAME") or None,
    ).render_as_string(hide_password=False)
