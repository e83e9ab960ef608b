"""Django and Django REST framework: idempotent views, and phases that write with the ORM.

Install with ``pip install 'recoverypoint[django]'``; add ``"recoverypoint.integrations.django"``
to ``INSTALLED_APPS`` for ``manage.py recoverypoint`` (the ``recoverypoint`` command with
Django set up: the workers, migrations, keys).

::

    from recoverypoint.integrations.django import Idempotency, django_engine

    engine = django_engine()            # on Django's own connection, DATABASES["default"]
    idempotency = Idempotency(engine)   # scope: the authenticated user

    @idempotency.single_step("create_order")
    def create_order(request): ...      # or a CBV's / a DRF view's method

    def post_ride(request):
        return idempotency.run(rides, request)   # a phased operation

See :mod:`._connection` for how a phase's ORM writes commit with its recovery point,
:mod:`._views` for what the views answer, and :mod:`._spectacular` for what drf-spectacular's
schema says of them (when it is installed).
"""

from contextlib import suppress
from importlib.util import find_spec

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

from ._connection import django_engine
from ._views import Idempotency, authenticated_user

if find_spec("drf_spectacular") is not None:
    # Imported before Django's settings, drf-spectacular cannot load (nor generate) either.
    with suppress(ImproperlyConfigured):
        from . import _spectacular  # noqa: F401  its view extension registers itself

__all__ = ["Idempotency", "authenticated_user", "django_engine"]
