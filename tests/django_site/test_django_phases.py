"""Phases that write with the Django ORM: their writes commit with the recovery point or not
at all; a crash between phases is resumed by the completer; the workers under manage.py."""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import OperationalError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.test import Client
from rest_framework.authtoken.models import Token
from sqlalchemy.engine import make_url

import recoverypoint as rp
from examples.django_rides.rides import operations
from examples.django_rides.rides.models import AuditRecord, Ride
from recoverypoint.workers.completer import Completer

pytestmark = pytest.mark.django_db(transaction=True)


class Boom(Exception):
    pass


@pytest.fixture
def user() -> User:
    return User.objects.create_user(f"rider-{uuid.uuid4()}")


def recovery_point(key: str) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT recovery_point FROM idempotency_keys WHERE idempotency_key = %s", [key]
        )
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def failing_after_orm_writes(name: str, fail: list[bool]) -> rp.Operation[Any]:
    """Writes a ride and its audit record with the ORM, get_or_create and a savepoint
    included, then fails while ``fail`` is true."""
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("written")
    def write(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        ride = Ride.objects.create(
            user_id=params["user_id"], origin="a", target="b", key_id=tx.key_id
        )
        AuditRecord.objects.get_or_create(
            user_id=params["user_id"], action="ride.created", key_id=tx.key_id
        )
        try:
            with transaction.atomic():  # a savepoint inside the phase's transaction
                AuditRecord.objects.create(
                    user_id=params["user_id"], action="undone", key_id=tx.key_id
                )
                raise Boom("rolled back to the savepoint")
        except Boom:
            pass
        tx.state["ride_id"] = ride.pk
        if fail[0]:
            raise Boom("after the ORM's writes")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        return rp.Response(201, {"ride_id": tx.state["ride_id"]})

    operations.engine.register(op)
    return op


def test_a_phase_that_fails_after_orm_writes_leaves_none_of_them(user: User) -> None:
    fail = [True]
    op = failing_after_orm_writes(f"orm_atomicity_{uuid.uuid4().hex}", fail)
    key = str(uuid.uuid4())
    with pytest.raises(Boom):
        operations.engine.run(op, key=key, scope=str(user.pk), params={"user_id": user.pk})
    assert Ride.objects.filter(user=user).count() == 0
    assert AuditRecord.objects.filter(user=user).count() == 0
    assert recovery_point(key) in (None, "started")  # nothing of the phase committed

    fail[0] = False
    outcome = operations.engine.run(op, key=key, scope=str(user.pk), params={"user_id": user.pk})
    assert outcome.status == 201
    assert Ride.objects.filter(user=user).count() == 1
    # get_or_create's row, and not the one rolled back to its savepoint
    assert list(AuditRecord.objects.filter(user=user).values_list("action", flat=True)) == [
        "ride.created"
    ]
    assert recovery_point(key) == "finished"


def test_a_phase_may_not_commit_through_the_orm(user: User) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_commit_{uuid.uuid4().hex}")

    @op.atomic_phase("finished")
    def commits(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        Ride.objects.create(user_id=user.pk, origin="a", target="b", key_id=tx.key_id)
        with connection.cursor() as cursor:
            cursor.execute("COMMIT")

    operations.engine.register(op)
    with pytest.raises(rp.TransactionEnded):
        operations.engine.run(op, key=str(uuid.uuid4()), scope="s", params={})
    assert Ride.objects.filter(user=user).count() == 0


def test_the_engine_refuses_to_run_inside_an_atomic_block(user: User) -> None:
    op = failing_after_orm_writes(f"orm_in_atomic_{uuid.uuid4().hex}", [False])
    with transaction.atomic(), pytest.raises(rp.ConfigurationError, match="atomic"):
        operations.engine.run(op, key=str(uuid.uuid4()), scope="s", params={"user_id": user.pk})


def rides_client(user: User) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")


def test_rocket_rides_through_drf_books_once_and_replays(user: User) -> None:
    client, key = rides_client(user), str(uuid.uuid4())
    body = {"origin": "Montreal", "target": "Quebec"}
    first = client.post(
        "/rides", body, content_type="application/json", headers={"Idempotency-Key": key}
    )
    again = client.post(
        "/rides", body, content_type="application/json", headers={"Idempotency-Key": key}
    )
    assert first.status_code == again.status_code == 201, first.content
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    ride = Ride.objects.get(user=user)
    assert ride.charge_id == first.json()["charge_id"]
    # DRF's own validation answers before any key is claimed
    bad = client.post(
        "/rides",
        {"origin": "x"},
        content_type="application/json",
        headers={"Idempotency-Key": str(uuid.uuid4())},
    )
    assert bad.status_code == 400 and Ride.objects.filter(user=user).count() == 1


def crash_a_ride(user: User, monkeypatch: pytest.MonkeyPatch) -> tuple[Client, str, list[str]]:
    """A booking whose process died after the provider charged: the ride committed, the
    charge not; the key due at once rather than after its backoff."""
    charges: list[str] = []
    real_charge = operations.provider.charge

    def charge_then_crash(key: str, amount: int) -> str:
        charges.append(real_charge(key, amount))
        raise Boom("the process died after the provider charged")

    monkeypatch.setattr(operations.provider, "charge", charge_then_crash)
    client, key = rides_client(user), str(uuid.uuid4())
    crashed = client.post(
        "/rides",
        {"origin": "a", "target": "b"},
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    assert crashed.status_code == 500
    assert recovery_point(key) == "ride_created"
    assert Ride.objects.get(user=user).charge_id is None
    monkeypatch.setattr(operations.provider, "charge", real_charge)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE idempotency_keys SET next_attempt_at = now() WHERE idempotency_key = %s",
            [key],
        )
    return client, key, charges


def test_a_crash_between_phases_is_resumed_by_the_completer(
    user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, key, charges = crash_a_ride(user, monkeypatch)
    result = Completer(operations.engine, min_age=0).run_once()
    assert result.finished == 1, result
    assert recovery_point(key) == "finished"
    ride = Ride.objects.get(user=user)  # one ride, charged once, with the first charge
    assert ride.charge_id == charges[0]
    assert len(operations.provider.charges) == len(set(operations.provider.charges.values()))
    replay = client.post(
        "/rides",
        {"origin": "a", "target": "b"},
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    assert replay.status_code == 201 and replay.json()["charge_id"] == charges[0]


def test_manage_py_recoverypoint_migrates_and_runs_the_workers(
    user: User, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    call_command("recoverypoint", "migrate")  # Django's database, already at the newest
    assert "(head)" in capsys.readouterr().out
    _, key, charges = crash_a_ride(user, monkeypatch)
    call_command(
        "recoverypoint",
        "worker",
        "completer",
        "--once",
        "--min-age",
        "0",
        "--app",
        "examples.django_rides.rides.operations:engine",
    )
    assert recovery_point(key) == "finished"
    assert Ride.objects.get(user=user).charge_id == charges[0]
    # The worker's logging ended with it: this process logs as it did before.
    assert (root.handlers, root.level) == (handlers, level)


def test_json_reads_as_each_side_expects_in_a_phase(user: User) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_jsonb_{uuid.uuid4().hex}")
    seen: dict[str, Any] = {}

    @op.atomic_phase("finished")
    def read(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        seen["engine"] = tx.scalar("""SELECT '{"a": 1}'::jsonb""")
        with connection.cursor() as cursor:  # Django decodes jsonb itself
            cursor.execute("""SELECT '{"a": 1}'::jsonb""")
            seen["django"] = cursor.fetchone()[0]
        return rp.Response(200, {"a": 1})

    operations.engine.register(op)
    outcome = operations.engine.run(op, key=str(uuid.uuid4()), scope="s", params={})
    assert outcome.body == {"a": 1}
    assert seen == {"engine": {"a": 1}, "django": '{"a": 1}'}
    with connection.cursor() as cursor:  # and so it does once the engine gave it back
        cursor.execute("""SELECT '{"a": 1}'::jsonb""")
        assert cursor.fetchone()[0] == '{"a": 1}'


def test_an_async_view_runs_phases_on_the_orm(user: User) -> None:
    client = Client()
    client.force_login(user)
    key = str(uuid.uuid4())
    answers = [
        client.post(
            "/async-rides",
            {"origin": "a", "target": "b"},
            content_type="application/json",
            headers={"Idempotency-Key": key},
        )
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [201, 201], answers[0].content
    assert answers[1].json() == answers[0].json()
    assert Ride.objects.get(user=user).charge_id == answers[0].json()["charge_id"]


def test_an_async_single_step_view_uses_the_async_orm(user: User) -> None:
    from . import views

    client = Client()
    client.force_login(user)
    key, before = str(uuid.uuid4()), views.RUNS["async_orm"]
    first = client.post(
        "/async-orm", b"", content_type="application/json", headers={"Idempotency-Key": key}
    )
    again = client.post(
        "/async-orm", b"", content_type="application/json", headers={"Idempotency-Key": key}
    )
    assert first.status_code == again.status_code == 201, first.content
    assert again.content == first.content and views.RUNS["async_orm"] == before + 1
    assert AuditRecord.objects.filter(user=user, action="async.view").count() == 1


def test_a_key_in_flight_is_409_with_retry_after(user: User) -> None:
    from . import views

    answers: list[Any] = []
    key = str(uuid.uuid4())

    def first() -> None:
        try:
            client = Client()
            client.force_login(user)
            answers.append(
                client.post(
                    "/held", b"", content_type="application/json", headers={"Idempotency-Key": key}
                )
            )
        finally:
            connection.close()  # this thread's own

    views.ENTERED.clear()
    views.RELEASE.clear()
    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert views.ENTERED.wait(timeout=60)
        client = Client()
        client.force_login(user)
        busy = client.post(
            "/held", b"", content_type="application/json", headers={"Idempotency-Key": key}
        )
        assert busy.status_code == 409
        assert busy["Content-Type"] == "application/problem+json" and busy["Retry-After"]
    finally:
        views.RELEASE.set()
        thread.join()
    assert answers[0].status_code == 201 and views.RUNS["held"] == 1


def test_on_commit_in_a_phase_raises(user: User) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_on_commit_{uuid.uuid4().hex}")

    @op.atomic_phase("finished")
    def later(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        Ride.objects.create(user_id=user.pk, origin="a", target="b", key_id=tx.key_id)
        transaction.on_commit(lambda: None)  # a staged job is the phase's way

    operations.engine.register(op)
    with pytest.raises(TransactionManagementError):
        operations.engine.run(op, key=str(uuid.uuid4()), scope="s", params={})
    assert Ride.objects.filter(user=user).count() == 0


def test_a_foreign_step_runs_outside_any_transaction(user: User) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_foreign_{uuid.uuid4().hex}")
    seen: dict[str, Any] = {}

    @op.foreign_step("noted")
    def note(step: rp.StepContext, params: dict[str, Any]) -> None:
        seen["in_atomic_block"] = connection.in_atomic_block
        seen["status"] = connection.connection.info.transaction_status.name
        AuditRecord.objects.create(user=user, action="noted", key_id=0)  # commits on its own

    @op.atomic_phase("finished")
    def fail(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
        raise Boom("after the step")

    operations.engine.register(op)
    with pytest.raises(Boom):
        operations.engine.run(op, key=str(uuid.uuid4()), scope="s", params={})
    assert seen == {"in_atomic_block": False, "status": "IDLE"}
    assert AuditRecord.objects.filter(user=user, action="noted").count() == 1


@pytest.mark.parametrize("lost", ["under the engine", "under Django", "on another thread"])
def test_a_lost_connection_is_made_anew(user: User, server_url: str, lost: str) -> None:
    op: rp.Operation[Any] = rp.Operation(f"orm_outage_{uuid.uuid4().hex}")

    @op.atomic_phase("finished")
    def book(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
        Ride.objects.create(user=user, origin="a", target="b", key_id=tx.key_id)
        assert tx.scalar("SELECT '{}'::jsonb") == {}  # on the connection the engine set up
        return rp.Response(201, {})

    operations.engine.register(op)
    run = functools.partial(operations.engine.run, op, scope="s", params={})
    assert run(key=str(uuid.uuid4())).status == 201  # the engine holds a record of it
    connection.ensure_connection()
    backend = connection.connection.info.backend_pid
    with psycopg.connect(
        make_url(server_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    ) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [backend])
    if lost == "under the engine":
        with pytest.raises(rp.DatabaseUnavailable):
            run(key=str(uuid.uuid4()))
    elif lost == "under Django":  # which keeps the closed connection until a request ends
        with pytest.raises(OperationalError):
            Ride.objects.count()
    else:  # an outage another thread met: every connection made before it is made anew
        operations.engine.db.pool._invalidate_time = time.time()
    assert run(key=str(uuid.uuid4())).status == 201
    assert connection.connection.info.backend_pid != backend
    assert Ride.objects.filter(user=user).count() == 2
