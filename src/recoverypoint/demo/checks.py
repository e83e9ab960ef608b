"""After the run: what the database holds, set against what the clients saw.

Each request the load sent ends in one of these:

- **finished by its client**: the client's last answer was final (201, or 402 for a
  declined card), and the key record stores that same answer;
- **finished by the completer**: the client gave up (connection errors, 409s or 5xx
  until its attempts ran out) and the completer finished the key afterwards;
- **abandoned**: the completer gave the key up after ``max_attempts`` failures;
- **never accepted**: the client gave up and no key record exists. The server never
  took the request in (an attempt that died before the claim committed leaves nothing),
  so nothing happened, which the client was told with a 5xx or a dropped connection;
- **lost**: a key record exists and is still unfinished at the end.

Invariants (each a count that must be 0): duplicate charges (two charges for one ride),
rides without exactly one charge (no charge for a ride whose key was declined), charges
without a ride, lost requests, abandoned requests (under the demo's fault rates, a key
out of attempts means a phase that can never succeed), answers that contradict the
database, unexpected answers (a 4xx the demo never provokes), receipts lost (a booked
ride without a receipt), receipts sent twice, and receipts published twice.

Publishing is at least once: an enqueuer killed between publishing a batch and deleting
it publishes it again after its restart. So a receipt may be *delivered* more than once,
but only by enqueuer processes that then died by an injected fault; each receipt job is
delivered at most once by a process that lived on, and *sent* exactly once whatever
happened (``consume_once``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from ..keys import downstream_key_of, record_material
from .load import FINAL, LoadResult

_KEYS = sa.text(
    "SELECT idempotency_key, finished_at IS NOT NULL AS finished, "
    "abandoned_at IS NOT NULL AS abandoned, response_status, response_body "
    "FROM idempotency_keys WHERE operation = 'create_ride'"
)
_RIDES = sa.text(
    "SELECT r.id, r.charge_id, k.response_status, k.id AS key_id, k.created_at, k.operation, "
    "k.derivation_seed, k.generation, k.window_renewals FROM rides AS r "
    # On the scope too: on Citus, a join of co-located tables on their distribution column.
    "LEFT JOIN idempotency_keys AS k ON k.id = r.idempotency_key_id AND k.scope = r.scope"
)
_CHARGES = sa.text("SELECT id, idempotency_key FROM provider_charges")
# The step whose calls charge: a ride's charges are those made with the downstream keys its
# request derives for it (the charge carries nothing of the ride's, whose id a lossy
# failover may change: see rocket_rides.api._charge).
_CHARGE_STEP = "charge_created"
_RECEIPTS = sa.text("SELECT ride_id, count(*) AS sent FROM receipts GROUP BY ride_id")
_DELIVERIES = sa.text("SELECT job_key, enqueuer_pid FROM receipt_deliveries")

_EXAMPLES = 5


@dataclass
class Invariant:
    name: str
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, example: object) -> None:
        self.count += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(str(example))


@dataclass
class Checked:
    """The figures the database gives and the invariants, by name."""

    figures: dict[str, int]
    invariants: dict[str, Invariant]

    @property
    def ok(self) -> bool:
        return all(invariant.count == 0 for invariant in self.invariants.values())


def _charge_keys(ride: Any) -> list[str]:
    """The downstream keys the charge step of ``ride``'s request hands the provider: its
    first, and one per renewal past the provider's window (none without a key row)."""
    if ride.key_id is None:
        return []
    material = record_material(
        ride.derivation_seed, ride.key_id, ride.created_at, ride.operation, ride.generation
    )
    return [
        downstream_key_of(material, _CHARGE_STEP, renewals=n)
        for n in range(ride.window_renewals + 1)
    ]


def check(db: sa.Engine, load: LoadResult, crashed_enqueuers: set[int]) -> Checked:
    with db.connect() as conn:
        keys = {row.idempotency_key: row for row in conn.execute(_KEYS)}
        rides = conn.execute(_RIDES).all()
        charges = conn.execute(_CHARGES).all()
        receipts = {row.ride_id: row.sent for row in conn.execute(_RECEIPTS)}
        deliveries = conn.execute(_DELIVERIES).all()

    invariants = {
        name: Invariant(name)
        for name in (
            "duplicate charges",
            "rides without exactly one charge",
            "charges without a ride",
            "lost requests",
            "abandoned requests",
            "answers contradicting the database",
            "unexpected answers",
            "receipts lost",
            "receipts sent twice",
            "receipts published twice",
        )
    }
    outcomes: Counter[str] = Counter()
    for sent in load.sent:
        key = keys.get(sent.key)
        if sent.status in FINAL:
            outcomes["finished by clients"] += 1
            if not _agrees(sent.status, sent.body, key):
                invariants["answers contradicting the database"].add(sent.key)
        elif sent.status is not None and sent.status < 500 and sent.status not in (409, 429):
            invariants["unexpected answers"].add(f"{sent.key}: {sent.status} {sent.body}")
        elif key is None:
            outcomes["never accepted"] += 1
        elif not key.finished:
            invariants["lost requests"].add(sent.key)
        elif key.abandoned:
            invariants["abandoned requests"].add(sent.key)
        else:
            outcomes["finished by the completer"] += 1

    charge_of_key = {charge.idempotency_key: charge.id for charge in charges}
    attributed: set[str] = set()
    for ride in rides:
        expected = 0 if ride.response_status == 402 else 1
        mine = [charge_of_key[k] for k in _charge_keys(ride) if k in charge_of_key]
        attributed.update(mine)
        if len(mine) > 1:
            invariants["duplicate charges"].add(f"ride {ride.id}: {len(mine)} charges")
        if len(mine) != expected or (expected and ride.charge_id not in mine):
            invariants["rides without exactly one charge"].add(
                f"ride {ride.id}: {len(mine)} charges, key answered {ride.response_status}"
            )
        if ride.response_status == 201 and receipts.get(ride.id, 0) == 0:
            invariants["receipts lost"].add(f"ride {ride.id}")
        if receipts.get(ride.id, 0) > 1:
            invariants["receipts sent twice"].add(f"ride {ride.id}: {receipts[ride.id]}")
    for charge in charges:
        if charge.id not in attributed:
            invariants["charges without a ride"].add(charge.id)

    by_survivors = Counter(d.job_key for d in deliveries if d.enqueuer_pid not in crashed_enqueuers)
    for job_key, times in by_survivors.items():
        if times > 1:
            invariants["receipts published twice"].add(f"{job_key}: {times} times")
    published = len({d.job_key for d in deliveries})

    figures = {
        "rides": len(rides),
        "declined (402)": sum(1 for key in keys.values() if key.response_status == 402),
        "charges at the provider": len(charges),
        "finished by clients": outcomes["finished by clients"],
        "finished by the completer": outcomes["finished by the completer"],
        "never accepted": outcomes["never accepted"],
        "receipts published": published,
        "receipts sent": sum(receipts.values()),
        "redeliveries after an enqueuer crash": len(deliveries) - published,
    }
    return Checked(figures, invariants)


def _agrees(status: int | None, body: Any, key: Any) -> bool:
    """Whether the key record stores the final answer the client got."""
    if key is None or not key.finished or key.response_status != status:
        return False
    return status != 201 or (
        isinstance(body, dict) and body.get("ride_id") == (key.response_body or {}).get("ride_id")
    )
