"""A wallet debited by an atomic phase that writes with the ORM, then does what ``ESCAPE``
holds (the tests put there each way phase code could end the phase's transaction), served
by a plain view, an async view and a DRF view."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse
from rest_framework.request import Request
from rest_framework.views import APIView

import recoverypoint as rp
from examples.django_rides.rides.models import AuditRecord
from examples.django_rides.rides.operations import engine, idempotency

WALLETS = """
CREATE TABLE IF NOT EXISTS test_wallets (id bigint PRIMARY KEY, balance integer NOT NULL)
"""

# What the debiting phase does after its writes; None: nothing.
ESCAPE: list[Callable[[], object] | None] = [None]

debit_wallet: rp.Operation[Any] = rp.Operation("django_debit_wallet")


@debit_wallet.atomic_phase("debited")
def debit(tx: rp.AtomicContext, params: dict[str, Any]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE test_wallets SET balance = balance - 1 WHERE id = %s", [params["wallet"]]
        )
    AuditRecord.objects.create(user_id=params["user_id"], action="debit", key_id=tx.key_id)
    escape = ESCAPE[0]
    if escape is not None:
        escape()


@debit_wallet.atomic_phase("finished")
def finish(tx: rp.AtomicContext, params: dict[str, Any]) -> rp.Response:
    return rp.Response(201, {"wallet": params["wallet"]})


engine.register(debit_wallet)


def _params(request: HttpRequest) -> dict[str, Any]:
    return {"wallet": json.loads(request.body)["wallet"], "user_id": request.user.pk}


def wallet_view(request: HttpRequest) -> HttpResponse:
    return idempotency.run(debit_wallet, request, _params(request))


async def wallet_async_view(request: HttpRequest) -> HttpResponse:
    user = await request.auser()
    params = {"wallet": json.loads(request.body)["wallet"], "user_id": user.pk}
    return await idempotency.arun(debit_wallet, request, params)


class WalletDRFView(APIView):
    def post(self, request: Request) -> HttpResponse:
        params = {"wallet": request.data["wallet"], "user_id": request.user.pk}
        return idempotency.run(debit_wallet, request, params)
