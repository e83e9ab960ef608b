"""The Django application that brings ``manage.py recoverypoint``, and finds the
project's operations in every installed app."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]
from django.utils.module_loading import autodiscover_modules  # type: ignore[import-untyped]

OPERATION_MODULE = "idempotency"
"""The module of every installed app imported once Django is ready, as the admin imports
each app's ``admin`` module: the operations it registers (``engine.register(...)``) are
known to every process of the project, ``manage.py recoverypoint worker`` among them, which
imports nothing of the project's on its own. An app that has none is passed over; one whose
module fails to import stops Django's start, with the error. One name, and not a generic
one such as ``operations``: every installed app's module of that name would be imported,
third-party apps' (and ``django.contrib.postgres.operations``) included."""


class RecoverypointConfig(AppConfig):  # type: ignore[misc]
    name = "recoverypoint.integrations.django"
    label = "recoverypoint"
    verbose_name = "recoverypoint"

    def ready(self) -> None:
        autodiscover_modules(OPERATION_MODULE)
