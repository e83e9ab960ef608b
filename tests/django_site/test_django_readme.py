"""README, "Django and DRF", run word for word: its blocks are the modules their first
lines name (``myproject.idempotency``, and one module for the views, the operation and the
URLs), ``rides.models`` is Rocket Rides' (examples/django_rides), and ``payments`` a fake
provider that counts its calls. Its shell lines run as ``manage.py`` would run them."""

from __future__ import annotations

import re
import shlex
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from rest_framework.authtoken.models import Token

import examples.django_rides.rides
import examples.django_rides.rides.models
import recoverypoint as rp
from examples.django_rides.rides.models import Ride

pytestmark = pytest.mark.django_db(transaction=True)

README = Path(__file__).resolve().parents[2] / "README.md"
TITLE = "## Django and DRF\n"


def section() -> str:
    return README.read_text().split(TITLE, 1)[1].split("\n## ", 1)[0]


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
    python = blocks("python")
    assert [block.splitlines()[0] for block in python[:4]] == [
        "# myproject/idempotency.py",
        "# orders/views.py",
        "# rides/operations.py",
        "# myproject/urls.py",
    ]
    project = types.ModuleType("myproject")
    project.__path__ = []
    idempotency = types.ModuleType("myproject.idempotency")
    urls = types.ModuleType("myproject.urls")
    for module in (project, idempotency, urls):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, "rides", examples.django_rides.rides)
    monkeypatch.setitem(sys.modules, "rides.models", examples.django_rides.rides.models)
    exec(compile(python[0], "README.md", "exec"), idempotency.__dict__)
    # The views, the operation, the URLs and the rest: one module, as they refer to each other.
    namespace = urls.__dict__
    namespace["payments"] = Payments()
    for block in python[1:]:
        exec(compile(block, "README.md", "exec"), namespace)
    settings.ROOT_URLCONF = "myproject.urls"
    return namespace


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


def test_the_shell_lines_run_under_manage_py(
    readme: dict[str, Any], client: Client, user: User
) -> None:
    user.email = "rider@example.com"
    user.save()
    booked = client.post(
        "/rides",
        {"origin": "a", "target": "b"},
        content_type="application/json",
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert booked.status_code == 201
    [shell] = blocks("shell")
    commands = [shlex.split(line.split("#")[0]) for line in shell.splitlines()]
    assert all(command[:2] == ["python", "manage.py"] for command in commands)
    for command in commands:
        args = command[2:]
        if args[:2] == ["recoverypoint", "worker"]:
            args.append("--once")  # one pass, rather than until stopped
        call_command(*args)
    # The enqueuer published the staged receipt, which the handler sent.
    assert [(m.subject, m.to) for m in mail.outbox] == [("Your ride", ["rider@example.com"])]
