"""Rocket Rides the Django way: settings. The database is $RECOVERYPOINT_DATABASE_URL's."""

from __future__ import annotations

import os

from sqlalchemy.engine import make_url

_url = make_url(
    os.environ.get("RECOVERYPOINT_DATABASE_URL", "postgresql://postgres@127.0.0.1/rides")
)

SECRET_KEY = "rocket-rides-example-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "examples.django_rides.urls"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "rest_framework",
    "rest_framework.authtoken",
    "recoverypoint.integrations.django",  # manage.py recoverypoint
    "examples.django_rides.rides",
]
MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
        # Every view in a transaction, as many projects have it: recoverypoint's views
        # are kept out of it (they commit each phase with its recovery point).
        "ATOMIC_REQUESTS": True,
    }
}
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
