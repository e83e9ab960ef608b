"""A key's generation: which use of a key (scope, operation, key) a request is.

A key reused after its retention is a new request (every phase runs), and the providers it
calls must see it as one: a provider that refuses a known key with other params (Stripe's
rule) would fail it forever, one that remembers keys longer would skip its charge. So every
key derived for a request is made from its generation too
(:func:`recoverypoint.keys.record_material`; generation 0 derives the keys of rows written
before generations existed). The rule, written here once in SQL:

- every deletion of a key row (the claim of a reuse past the retention, the reaper, an
  operator's ``keys delete`` and ``keys purge``) records the key's next generation in
  ``key_generations``, in the statement that deletes the row (:func:`record_next`, or
  :func:`record` where the deletion knows it beforehand);
- the claim that inserts a key row takes the recorded generation, 0 when none: read by the
  INSERT itself on one server (:data:`recoverypoint.engine.sql.CLAIM`), by the lookup
  before its transaction where Citus distributes the keys
  (:data:`recoverypoint.engine.sql.FIND_FINISHED_BOUND`).

A row lost in a failover to a lagging standby is claimed again at the generation it had:
its deletion's record was lost with it, or kept with it, as the two were written in one
transaction. So a retry after a failover hands the provider the keys it already saw.

Every statement names the key's scope, so it stays on the scope's shard (``key_generations``
is distributed by scope, co-located with ``idempotency_keys``).
"""

from __future__ import annotations

from datetime import timedelta

DEFAULT_GENERATIONS_RETENTION = timedelta(days=30)
"""How long the reaper keeps a key's recorded generation after the key row was deleted.
Once it is pruned, a reuse of the key is generation 0 again and derives the keys the first
request did: safe only when every provider has forgotten them. Providers remember keys for
hours to days (Stripe 24 hours, most others at most 7 days), so 30 days is far beyond any."""


def record_next(deleted: str) -> str:
    """SQL: the CTE ``generations``, which records the next generation of every key row the
    CTE ``deleted`` returns (its scope, operation, idempotency_key and generation). To
    follow ``deleted`` in the WITH of the statement that deletes the rows."""
    return _record(
        f"""SELECT d.scope, d.operation, d.idempotency_key, d.generation + 1, now()
        FROM {deleted} AS d"""
    )


def record(scope: str, operation: str, key: str, generation: str) -> str:
    """SQL: the CTE ``generations``, which records ``generation`` as the next generation of
    the key (all four are placeholders), for a deletion that knows it before it runs (the
    claim of a reuse past its retention, from its lookup). From VALUES, not from the deleted
    rows: Citus then runs it on the scope's shard alone, like the deletion, whereas it sends
    the rows of a CTE on to every worker, or inserts them by a command to every shard, and
    commits either by two-phase commit."""
    return _record(f"VALUES ({scope}, {operation}, {key}, {generation}, now())")


def _record(rows: str) -> str:
    # greatest(): a recorded generation never goes back, whatever order deletions come in.
    # The deletion's time comes in with the inserted row: Citus refuses a function that is
    # not IMMUTABLE (now()) in DO UPDATE SET.
    return f"""generations AS (
        INSERT INTO key_generations AS g (
            scope, operation, idempotency_key, generation, deleted_at)
        {rows}
        ON CONFLICT (idempotency_key, scope, operation) DO UPDATE
        SET generation = greatest(g.generation, excluded.generation),
            deleted_at = excluded.deleted_at
    )"""


# What the DELETE of key rows ``k`` returns for record_next().
DELETED = "k.scope, k.operation, k.idempotency_key, k.generation"
