"""A phase that tries to end its own transaction through Django, every way Django offers
(``transaction.commit()``, ``connection.rollback()``, ``set_autocommit()``,
``atomic(durable=True)``, a ``COMMIT`` through a cursor, psycopg's connection under Django's),
is refused before anything commits: its writes roll back, the client gets a problem answer
that says whose fault it is, the key holds no lease, and once the phase is fixed the retry
debits the wallet once."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from docs_snippets import ROOT, blocks
from hypothesis import HealthCheck, given, settings
from rest_framework.authtoken.models import Token
from sql_endings import ending, texts

import recoverypoint as rp
from examples.django_rides.rides.models import AuditRecord
from examples.django_rides.rides.operations import engine

from .wallet_views import ESCAPE, WALLETS, debit_wallet

pytestmark = pytest.mark.django_db(transaction=True)

VIEWS = {"function": "/wallet", "async": "/wallet-async", "drf": "/wallet-drf"}


def _cursor(statement: str) -> Callable[[], None]:
    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(statement)

    return run


def _in_atomic(end: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with transaction.atomic():
            end()

    return run


def _durable() -> None:
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute("UPDATE test_wallets SET balance = 0")


ESCAPES: dict[str, Callable[[], object]] = {
    "transaction.commit()": lambda: transaction.commit(),
    "transaction.rollback()": lambda: transaction.rollback(),
    "transaction.set_autocommit(True)": lambda: transaction.set_autocommit(True),
    "transaction.set_autocommit(False)": lambda: transaction.set_autocommit(False),
    "connection.commit()": lambda: connection.commit(),
    "connection.rollback()": lambda: connection.rollback(),
    "commit() in atomic()": _in_atomic(lambda: transaction.commit()),
    "atomic(durable=True)": _durable,
    "cursor COMMIT": _cursor("COMMIT"),
    "cursor SELECT 1; commit": _cursor("SELECT 1; commit"),
    "cursor /* */ END": _cursor("/* done */ END"),
    "psycopg's commit()": lambda: connection.connection.commit(),
    "psycopg's execute(COMMIT)": lambda: connection.connection.execute("COMMIT"),
}


@pytest.fixture
def user() -> User:
    return User.objects.create_user(f"payer-{uuid.uuid4()}")


@pytest.fixture
def client(user: User) -> Client:
    """A session for the plain views, a token for DRF's."""
    client = Client(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    client.force_login(user)
    return client


@pytest.fixture
def wallet() -> Iterator[int]:
    """A wallet of its own with 1000 in it."""
    wallet_id = uuid.uuid4().int >> 65
    with connection.cursor() as cursor:
        cursor.execute(WALLETS)
        cursor.execute("INSERT INTO test_wallets VALUES (%s, 1000)", [wallet_id])
    yield wallet_id
    ESCAPE[0] = None


def balance(wallet: int) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT balance FROM test_wallets WHERE id = %s", [wallet])
        return int(cursor.fetchone()[0])


def debits(user: User) -> int:
    return AuditRecord.objects.filter(user=user, action="debit").count()


def leased(key: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM idempotency_keys "
            "WHERE idempotency_key = %s AND locked_at IS NOT NULL",
            [key],
        )
        return int(cursor.fetchone()[0])


def post(client: Client, url: str, wallet: int, key: str) -> Any:
    return client.post(
        url, {"wallet": wallet}, content_type="application/json", headers={"Idempotency-Key": key}
    )


# Every way through the plain view; the async and DRF views reach the same engine (on the
# thread of Django's connection), and show it with a few.
CASES = [(escape, "function") for escape in ESCAPES] + [
    (escape, view)
    for view in ("async", "drf")
    for escape in ("transaction.commit()", "atomic(durable=True)", "cursor SELECT 1; commit")
]


@pytest.mark.parametrize(("escape", "view"), CASES)
def test_a_phase_cannot_end_its_transaction(
    client: Client, user: User, wallet: int, view: str, escape: str
) -> None:
    key = str(uuid.uuid4())
    ESCAPE[0] = ESCAPES[escape]
    for _ in range(2):  # retried as the client would: refused each time, nothing committed
        refused = post(client, VIEWS[view], wallet, key)
        assert refused.status_code == 500, refused.content
        assert refused["Content-Type"] == "application/problem+json"
        assert refused.json()["type"].endswith(":transaction-ended"), refused.json()
        assert (balance(wallet), debits(user), leased(key)) == (1000, 0, 0)

    ESCAPE[0] = None  # the phase fixed: the retry runs it once, and the next one replays
    answers = [post(client, VIEWS[view], wallet, key) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201], answers[0].content
    assert answers[1]["Idempotent-Replayed"] == "true"
    assert (balance(wallet), debits(user)) == (999, 1)


def test_the_problem_answer_says_whose_fault_it_is(client: Client, wallet: int) -> None:
    ESCAPE[0] = ESCAPES["transaction.commit()"]
    problem = post(client, VIEWS["function"], wallet, str(uuid.uuid4())).json()
    assert problem == json.loads(documented("json"))  # docs/how-to/django.md, as it is
    assert "debited" not in problem["detail"]  # the phase's name is for the logs


def test_the_error_names_the_phase_and_the_way_out(user: User, wallet: int) -> None:
    ESCAPE[0] = ESCAPES["transaction.commit()"]
    with pytest.raises(rp.TransactionEnded) as refused:
        run(user, wallet)
    # as docs/how-to/django.md shows it, for a phase of its own
    assert str(refused.value).replace("'debited'", "'ride_created'") == documented("text")


def documented(language: str) -> str:
    """The block of docs/how-to/django.md in ``language`` that this module runs."""
    [block] = [
        b.body
        for b in blocks(ROOT / "docs" / "how-to" / "django.md")
        if b.lang == language and b.mark_value.endswith(Path(__file__).name)
    ]
    return block.strip()


def run(user: User, wallet: int) -> rp.Outcome:
    return engine.run(
        debit_wallet,
        key=str(uuid.uuid4()),
        scope=str(user.pk),
        params={"wallet": wallet, "user_id": user.pk},
    )


PHASES = settings(
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PHASES
@given(text=texts(ends=True, runnable=False))
@pytest.mark.slow
def test_any_ending_statement_through_the_cursor_is_refused(
    user: User, wallet: int, text: str
) -> None:
    ESCAPE[0] = _cursor(text)
    with pytest.raises(rp.TransactionEnded):
        run(user, wallet)
    assert (balance(wallet), debits(user)) == (1000, 0)


@PHASES
@given(text=texts(ends=False))
@pytest.mark.slow
def test_statements_that_end_nothing_run(user: User, wallet: int, text: str) -> None:
    ESCAPE[0] = _cursor(text)
    before = balance(wallet)
    assert run(user, wallet).status == 201
    assert balance(wallet) == before - 1


@PHASES
@given(statement=ending(runnable=False))
def test_an_ending_statement_alone_is_refused_through_executemany(
    user: User, wallet: int, statement: str
) -> None:
    def executemany() -> None:
        with connection.cursor() as cursor:
            cursor.executemany(statement, [[]])

    ESCAPE[0] = executemany
    with pytest.raises(rp.TransactionEnded):
        run(user, wallet)
    assert balance(wallet) == 1000
