"""docs/how-to/django.md ("Django and DRF") run word for word: its blocks are the modules
their first lines name (``myproject.idempotency``, ``orders.views``...), ``rides.models`` is
Rocket Rides' (examples/django_rides), and ``myproject.payments`` a fake provider that
counts its calls. Its shell lines run from a shell, in a project of their own:
test_django_project.py."""

from __future__ import annotations

import re
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from rest_framework.authtoken.models import Token

import examples.django_rides.rides
import examples.django_rides.rides.models
import recoverypoint as rp
from examples.django_rides.rides.models import Ride

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "django.md"


def section() -> str:
    return PAGE.read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), re.S)


class Payments:
    """The provider the section calls: one charge (or refund) per idempotency key."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.done: dict[str, str] = {}

    def charge(self, amount: int, *, idempotency_key: str) -> str:
        self.calls.append(idempotency_key)
        return self.done.setdefault(idempotency_key, f"ch_{uuid.uuid4().hex[:8]}")

    def refund(self, charge_id: str, *, idempotency_key: str) -> str:
        self.calls.append(idempotency_key)
        return self.done.setdefault(idempotency_key, f"re_{charge_id}")


@pytest.fixture
def readme(monkeypatch: pytest.MonkeyPatch, settings: Any) -> dict[str, Any]:
    """The section's blocks, each run as the module its first line names; ``rides`` is
    Rocket Rides' app (its models), ``myproject.payments`` a fake provider."""
    payments = types.ModuleType("myproject.payments")
    payments.payments = Payments()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rides", examples.django_rides.rides)
    monkeypatch.setitem(sys.modules, "rides.models", examples.django_rides.rides.models)
    for name in ("myproject", "orders"):
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, payments.__name__, payments)
    modules: dict[str, Any] = {}
    for block in blocks("python"):
        path = re.fullmatch(r"# (\w+)/(\w+)\.py", block.splitlines()[0])
        assert path, f"a block names its file first: {block.splitlines()[0]!r}"
        module = types.ModuleType(f"{path[1]}.{path[2]}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(block, "how-to/django.md", "exec"), module.__dict__)
        modules[module.__name__] = module
    assert list(modules) == [
        "myproject.idempotency",
        "orders.views",
        "rides.idempotency",
        "myproject.urls",
        "rides.refunds",
    ]
    settings.ROOT_URLCONF = "myproject.urls"
    return {"payments": payments.payments, "refund": modules["rides.refunds"].refund}


@pytest.fixture
def user() -> User:
    return User.objects.create_user(f"reader-{uuid.uuid4()}")


@pytest.fixture
def client(user: User) -> Client:
    client = Client(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    client.force_login(user)
    return client


@pytest.mark.parametrize("url", ["/orders", "/orders/async", "/orders/view", "/orders/drf"])
def test_the_single_step_views_answer_once_per_key(
    readme: dict[str, Any], client: Client, url: str
) -> None:
    key = str(uuid.uuid4())
    answers = [
        client.post(
            url, {"item": "tea"}, content_type="application/json", headers={"Idempotency-Key": key}
        )
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [201, 201], answers[0].content
    assert answers[1].content == answers[0].content
    assert answers[1]["Idempotent-Replayed"] == "true"
    assert Client().post(
        url, {}, content_type="application/json", headers={"Idempotency-Key": key}
    ).status_code in (401, 403)


def test_the_phased_operation_books_with_the_orm_once(
    readme: dict[str, Any], client: Client, user: User
) -> None:
    key = str(uuid.uuid4())
    body = {"origin": "Montreal", "target": "Quebec"}
    answers = [
        client.post(
            "/rides", body, content_type="application/json", headers={"Idempotency-Key": key}
        )
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [201, 201], answers[0].content
    ride = Ride.objects.get(user=user)
    assert answers[1].json() == {"ride_id": ride.pk, "charge_id": ride.charge_id}
    assert len(readme["payments"].calls) == 1

    refund = readme["refund"]
    assert refund(ride.pk) == refund(ride.pk) == {"refund_id": f"re_{ride.charge_id}"}
    assert len(readme["payments"].calls) == 2  # the refund ran once
    with transaction.atomic(), pytest.raises(rp.ConfigurationError):
        refund(ride.pk + 1)
