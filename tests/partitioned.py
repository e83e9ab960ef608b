"""The shape of a distributed database, on PostgreSQL itself: the tables Citus distributes
by ``scope`` (``idempotency_keys`` and those co-located with it) hash-partitioned by it.

Citus cannot be installed from any registry this project uses, and PostgreSQL's partitioned
tables obey the rule Citus's distributed tables do (every primary key and unique constraint
holds the partition column). A partition here stands for a shard: a statement whose plan
reads one partition of each table, the same one, would run on one worker.
"""

from __future__ import annotations

import re

import sqlalchemy as sa

from recoverypoint.distribute import SCOPED_KEY

PARTITIONED = ("idempotency_keys", "staged_jobs", "key_generations", "processed_messages")
PARTITIONS = 4

# A partition's name in a plan: the table's, then _p and its remainder.
PARTITION_NAME = re.compile(rf"\b({'|'.join(PARTITIONED)})_p(\d+)\b")


def partition_by_scope(db: sa.Engine) -> None:
    """Make the two tables of a freshly migrated, empty database partitioned by scope, with
    the same columns, defaults, identities, constraints and indexes."""
    with db.begin() as conn:
        for table in PARTITIONED:
            if table in SCOPED_KEY:  # as recoverypoint migrate --citus does
                conn.exec_driver_sql(SCOPED_KEY[table])
            conn.exec_driver_sql(f"ALTER TABLE {table} RENAME TO {table}_single")
            conn.exec_driver_sql(
                f"CREATE TABLE {table} (LIKE {table}_single INCLUDING ALL) "
                "PARTITION BY HASH (scope)"
            )
            conn.exec_driver_sql(f"DROP TABLE {table}_single")
            for n in range(PARTITIONS):
                conn.exec_driver_sql(
                    f"CREATE TABLE {table}_p{n} PARTITION OF {table} "
                    f"FOR VALUES WITH (MODULUS {PARTITIONS}, REMAINDER {n})"
                )


def partitions_read(plan: str) -> set[str]:
    """The remainders of the partitions a plan (``EXPLAIN``'s text) reads, of either table."""
    return {match[2] for match in PARTITION_NAME.finditer(plan)}
