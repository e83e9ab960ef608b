"""What a completer's pass costs with compensations declared, over many abandoned keys of
which it compensates none: the wall time of ``Completer.run_once()`` (median and fastest,
as the machine may be busy), each case on a database of its own beside finished keys.

- ``none``: no registered operation declares a compensation (the compensator runs no
  statement at all), over the ``compensated`` keys;
- ``compensated``: every abandoned key's compensation has committed;
- ``legacy``: keys abandoned before migration 0013 (never compensated);
- ``undeclared``: keys of an operation that declares no compensation, abandoned since
  0013 (so due), beside a registered operation that declares one.

    .venv/bin/python benchmarks/compensation_pass.py \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres [--keys 50000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import sqlalchemy as sa

import recoverypoint as rp
from recoverypoint import migrate
from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database
from recoverypoint.workers import Completer

# The rows each release's abandonment leaves, written for the old rule (next_attempt_at at
# the abandonment) and the column alike, so that one database serves both.
_ABANDONED = """
INSERT INTO idempotency_keys (scope, operation, operation_version, idempotency_key,
    request_method, request_path, request_params, fingerprint, recovery_point,
    finished_at, abandoned_at, next_attempt_at, response_status, response_headers,
    response_body, compensated_at, compensation_due_at)
SELECT 's' || (i % 100), :operation, 1, :kind || i, 'POST', '', '{}', 'f', 'charged',
    t, t, CASE WHEN :kind = 'legacy' THEN t - interval '1 minute' ELSE t END, 500, '{}',
    '{}', CASE WHEN :kind = 'compensated' THEN t END,
    CASE WHEN :kind = 'undeclared' THEN t END
FROM generate_series(1, :keys) AS i, (SELECT now() - interval '1 day' AS t) AS at
"""

# The keys a table with traffic holds beside them: finished, of other operations.
_FINISHED = """
INSERT INTO idempotency_keys (scope, operation, operation_version, idempotency_key,
    request_method, request_path, request_params, fingerprint, recovery_point,
    finished_at, response_status, response_headers, response_body)
SELECT 's' || (i % 100), 'op' || (i % 20), 1, 'f' || i, 'POST', '', '{}', 'f', 'finished',
    now() - interval '1 hour', 200, '{}', '{}'
FROM generate_series(1, :keys) AS i
"""


def operation(name: str, compensate: bool) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200, {})

    if compensate:

        @op.compensation
        def undo(tx: rp.AtomicContext, params: Any) -> None:
            return None

    return op


def timed_passes(url: str, operations: list[rp.Operation[Any]], passes: int) -> list[float]:
    engine = rp.Engine(url)
    for op in operations:
        engine.register(op)
    completer = Completer(engine, min_age=0)
    try:
        completer.run_once()  # warm: connections, plans
        times = []
        for _ in range(passes):
            began = time.perf_counter()
            result = completer.run_once()
            times.append(time.perf_counter() - began)
            assert result.compensated == result.compensation_failed == 0, result
        return times
    finally:
        completer.close()
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="a server to make databases on")
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--finished", type=int, default=200_000)
    parser.add_argument("--passes", type=int, default=50)
    args = parser.parse_args()
    server = args.database_url
    payment, plain = operation("payment", True), operation("plain", False)
    bare = operation("payment", False)
    scenarios = [
        ("none", "compensated", [bare]),
        ("compensated", "compensated", [payment]),
        ("legacy", "legacy", [payment]),
        ("undeclared", "undeclared", [payment, plain]),
    ]
    for name, kind, operations in scenarios:
        with temporary_database(server, prefix="rp_bench") as url:
            migrate.upgrade(url)
            db = create_engine(url)
            with db.begin() as conn:
                owner = "plain" if kind == "undeclared" else "payment"
                conn.execute(
                    sa.text(_ABANDONED), {"operation": owner, "kind": kind, "keys": args.keys}
                )
                conn.execute(sa.text(_FINISHED), {"keys": args.finished})
                conn.exec_driver_sql("ANALYZE idempotency_keys")
            db.dispose()
            times = timed_passes(url, operations, args.passes)
            print(
                f"{name:12} {args.keys} abandoned keys, {args.finished} finished: a pass takes "
                f"{statistics.median(times) * 1000:.1f} ms (median), "
                f"{min(times) * 1000:.1f} ms (fastest)"
            )


if __name__ == "__main__":
    main()
