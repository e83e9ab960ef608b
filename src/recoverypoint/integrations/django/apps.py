"""The Django application that brings ``manage.py recoverypoint``."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]


class RecoverypointConfig(AppConfig):  # type: ignore[misc]
    name = "recoverypoint.integrations.django"
    label = "recoverypoint"
    verbose_name = "recoverypoint"
