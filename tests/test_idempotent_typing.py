"""``@rp.idempotent`` keeps the decorated function's signature and return type for mypy
--strict, sync and async alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

pytestmark = pytest.mark.slow  # mypy

SNIPPET = """
import recoverypoint as rp
from pydantic import BaseModel


class Charge(BaseModel):
    id: str


engine = rp.Engine("postgresql://localhost/db")
async_engine = rp.AsyncEngine("postgresql://localhost/db")


@rp.idempotent(engine, key="order_id")
def charge(order_id: str, amount: int) -> Charge:
    return Charge(id=rp.downstream_key())


@rp.idempotent(async_engine, key=lambda args: str(args["order_id"]), scope="tenant")
async def charge_async(order_id: int, tenant: str, amount: int = 1) -> Charge:
    return Charge(id="x")


reveal_type(charge)
reveal_type(charge_async)
kept: Charge = charge("o-1", 2000)
charge("o-1", "2000")


async def main() -> None:
    awaited: Charge = await charge_async(1, "acme")
    await charge_async("1", "acme")
"""


def test_mypy_strict_sees_the_wrapped_signature_and_return_type(tmp_path: Path) -> None:
    module = tmp_path / "typed_calls.py"
    module.write_text(SNIPPET)
    out, _, status = api.run(
        ["--strict", "--no-incremental", "--cache-dir", str(tmp_path), str(module)]
    )
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if "typed_calls.py:" in line]
    assert lines == [
        'note: Revealed type is "def (order_id: str, amount: int) -> typed_calls.Charge"',
        'note: Revealed type is "def (order_id: int, tenant: str, amount: int =) '
        '-> typing.Coroutine[Any, Any, typed_calls.Charge]"',
        'error: Argument 2 to "charge" has incompatible type "str"; expected "int"  [arg-type]',
        'error: Argument 1 to "charge_async" has incompatible type "str"; expected "int"  '
        "[arg-type]",
    ], out
    assert status == 1
