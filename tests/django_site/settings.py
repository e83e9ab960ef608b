"""The Django project the Django integration's tests run: its own views (views.py) and
Rocket Rides' app from examples/django_rides. The database is made by conftest.py."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # for examples.django_rides
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
STATIC_URL = "static/"  # the live server serves static files under it
ROOT_URLCONF = "django_site.urls"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "rest_framework.authtoken",
    "recoverypoint.integrations.django",
    "examples.django_rides.rides",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "set by conftest.py",
        # As many projects have it: the integration's views must stay out of it.
        "ATOMIC_REQUESTS": True,
    }
}
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # drf-spectacular's, for test_django_openapi.py.
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Django 6.1's way to name the mail backend (the tests swap in locmem's).
MAILERS = {"default": {"BACKEND": "django.core.mail.backends.locmem.EmailBackend"}}
