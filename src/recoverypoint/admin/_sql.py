"""The SQL fragments the operator queries and actions share.

A key's state is computed by the database, on its clock, with the lock timeout its lease's
holder stored when it claimed the key (:data:`recoverypoint.leases.HOLDERS_TIMEOUT`), so a
listing, a filter and the re-check inside an action's UPDATE judge a lease as its holder
does, whether or not the operation is known here.
"""

from __future__ import annotations

from typing import Any

from ..leases import HOLDERS_TIMEOUT, REGISTERED, free, seconds_left

__all__ = [
    "DETAIL_COLUMNS",
    "KEY_COLUMNS",
    "LIVE",
    "REGISTERED",
    "STATE",
    "where",
]

# A lease nobody may take over: the negation of the engine's own rule. A held lease whose
# deadline is unknown (the rule is NULL) is live: it may be running a step right now.
LIVE = f"(k.finished_at IS NULL AND coalesce(NOT {free(HOLDERS_TIMEOUT)}, true))"

STATE = f"""
    CASE
        WHEN k.abandoned_at IS NOT NULL THEN 'abandoned'
        WHEN k.finished_at IS NOT NULL THEN 'finished'
        WHEN k.reconcile_since IS NOT NULL THEN 'needs-reconciliation'
        WHEN {LIVE} THEN 'in-flight'
        WHEN k.next_attempt_at
             < now() - make_interval(secs => CAST(:stuck_after AS double precision))
            THEN 'stuck'
        ELSE 'unfinished'
    END
"""

SECONDS = "extract(epoch FROM {})::float8"

KEY_COLUMNS = f"""
    k.id, k.scope, k.operation, k.operation_version AS version,
    k.idempotency_key AS key, k.recovery_point AS point, {STATE} AS state,
    k.attempts, k.next_attempt_at, {SECONDS.format("k.next_attempt_at - now()")} AS next_attempt_in,
    k.locked_at, k.lock_token, {HOLDERS_TIMEOUT} AS lock_timeout,
    CASE WHEN k.finished_at IS NULL THEN {seconds_left(HOLDERS_TIMEOUT)} END AS lease_left,
    k.response_status AS status, k.created_at, {SECONDS.format("now() - k.created_at")} AS age,
    k.last_run_at, k.finished_at, k.abandoned_at, k.last_error, k.compensated_at,
    k.compensation_due_at, k.compensation_attempts
"""


DETAIL_COLUMNS = """
    k.request_method, k.request_path, k.request_params, k.fingerprint,
    k.state AS phase_state, k.response_headers, k.response_body, k.derivation_seed,
    k.generation, k.window_renewals, k.reconcile_since,
    coalesce(k.point_reached_at, k.created_at) AS point_reached_at,
    extract(epoch FROM now() - coalesce(k.point_reached_at, k.created_at))::float8 AS point_age,
    EXISTS (SELECT 1 FROM registered AS r
            WHERE r.operation = k.operation AND r.version = k.operation_version) AS known
"""

# One fragment per filter; the values are always bound, never spliced.
_FILTERS = {
    "ids": "k.id = ANY(CAST(:ids AS bigint[]))",
    "operation": "k.operation = :operation",
    "version": "k.operation_version = :version",
    "scope": "k.scope = :scope",
    "key": "k.idempotency_key = :key",
    "point": "k.recovery_point = :point",
    "since": "k.created_at >= :since",
    "until": "k.created_at < :until",
    "status": "k.response_status = :status",
    "states": f"({STATE}) = ANY(CAST(:states AS text[]))",
    # The client's key, or a key record's id: what a support ticket quotes.
    "search": "(k.idempotency_key = :search OR k.id = CAST(:search_id AS bigint))",
    # Keyset pagination: the page after the key with this id, newest first.
    "before": "k.id < :before",
}

# What a state implies about indexed columns. The CASE above decides; these only let the
# planner reach the few unfinished or abandoned keys through their partial indexes instead
# of reading every finished key on the way.
_UNFINISHED_HINT = "k.finished_at IS NULL"
_STATE_HINTS = {
    "in-flight": f"{_UNFINISHED_HINT} AND k.locked_at IS NOT NULL",
    "stuck": f"""{_UNFINISHED_HINT} AND k.next_attempt_at
        < now() - make_interval(secs => CAST(:stuck_after AS double precision))""",
    "unfinished": _UNFINISHED_HINT,
    "finished": "k.finished_at IS NOT NULL",
    "abandoned": "k.abandoned_at IS NOT NULL",
    "needs-reconciliation": "k.reconcile_since IS NOT NULL",
}


def where(criteria: dict[str, Any]) -> str:
    """The WHERE condition for the filters set in ``criteria`` (name → bound value)."""
    clauses = [
        _FILTERS[name] for name, value in criteria.items() if value is not None and name in _FILTERS
    ]
    states = criteria.get("states")
    if states:
        hints = sorted({_STATE_HINTS[state] for state in states})
        clauses.append("(" + " OR ".join(f"({hint})" for hint in hints) + ")")
    return " AND ".join(clauses) or "true"
