"""pytest-django on a database of its own, made fresh on the test server for the session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import django
import pytest
from django.conf import settings

from django_site import settings as site

# Here rather than in pytest's options, and without DJANGO_SETTINGS_MODULE: the rest of the
# suite, and the processes it starts (a Celery worker sets Django up when it sees that
# variable), run without Django.
if not settings.configured:
    settings.configure(**{name: getattr(site, name) for name in dir(site) if name.isupper()})
    django.setup()


@pytest.fixture(scope="session")
def django_db_setup(
    server_url: str, django_test_environment: None, django_db_blocker: Any
) -> Iterator[None]:
    from django.test.utils import setup_databases, teardown_databases
    from sqlalchemy.engine import make_url

    from recoverypoint import migrate
    from recoverypoint.integrations.django.management.commands.recoverypoint import (
        database_url,
    )

    url = make_url(server_url)
    settings.DATABASES["default"].update(
        NAME=f"rp_django_{os.getpid()}",
        USER=url.username or "",
        PASSWORD=url.password or "",
        HOST=url.host or "",
        PORT=str(url.port or ""),
    )
    with django_db_blocker.unblock():
        old = setup_databases(verbosity=0, interactive=False)  # test_rp_django_<pid>
        migrate.upgrade(database_url())
    yield
    with django_db_blocker.unblock():
        teardown_databases(old, verbosity=0)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Keep the order pytest collected: pytest-django, once Django is set up, would move
    every test with a fixture named ``db`` (the suite's SQLAlchemy engine) to the front.
    These tests all use transactional databases, so Django needs no order of its own."""
    collected = {id(item): index for index, item in enumerate(items)}
    yield
    items.sort(key=lambda item: collected[id(item)])
