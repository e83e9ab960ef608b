"""``recoverypoint migrate --citus``'s surface without a cluster (tests/test_citus.py runs it
on one): the tables it names, what it refuses, and the SQL ``--sql`` prints."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recoverypoint.distribute import parse_colocated, statements

pytestmark = pytest.mark.slow  # the command line as subprocesses

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


def _migrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", "migrate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_sql_names_every_table_and_colocates_the_applications() -> None:
    result = _migrate(
        "--citus", "--sql", "--colocate", "rides", "--colocate", "bill.charges:tenant"
    )
    assert result.returncode == 0, result.stderr
    tail = result.stdout.split("-- Citus: distribute by scope (run on the coordinator)\n")[1]
    assert tail.splitlines() == statements(["rides", "bill.charges:tenant"])
    assert "SELECT create_distributed_table('idempotency_keys', 'scope');" in tail
    # Citus needs the scope in processed_messages' key before it distributes the table.
    rekeyed = tail.index("PRIMARY KEY (consumer, message_id, scope);")
    assert rekeyed < tail.index("create_distributed_table('processed_messages'")
    assert (
        "SELECT create_distributed_table('bill.charges', 'tenant', "
        "colocate_with => 'idempotency_keys');" in tail
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--colocate", "rides", "--sql"], "add --citus"),
        (["--citus", "--sql", "--colocate", "rides'); DROP TABLE x; --"], "TABLE:COLUMN"),
        (["--citus", "--sql", "--colocate", "a:b:c"], "TABLE:COLUMN"),
        (["--citus", "--sql", "--colocate", ""], "TABLE:COLUMN"),
    ],
)
def test_bad_colocation_is_a_usage_error_in_one_line(args: list[str], says: str) -> None:
    result = _migrate(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert says in result.stderr and result.stderr.count("\n") == 1


@given(st.text())
def test_a_colocated_table_is_plain_identifiers_or_refused(spec: str) -> None:
    try:
        table, column = parse_colocated(spec)
    except ValueError as exc:
        assert "TABLE:COLUMN" in str(exc)
        return
    assert all(IDENTIFIER.fullmatch(part) for part in table.split("."))
    assert IDENTIFIER.fullmatch(column)
    assert f"'{table}', '{column}'" in statements([spec])[-1]
