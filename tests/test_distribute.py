"""``recoverypoint migrate --citus``'s surface without a cluster (tests/test_citus.py runs it
on one): the tables it names, what it refuses, and the SQL ``--sql`` prints."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from recoverypoint import distribute
from recoverypoint.database import create_engine
from recoverypoint.distribute import parse_colocated, statements
from recoverypoint.errors import ConfigurationError

pytestmark = pytest.mark.slow  # the command line as subprocesses

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
# A server nobody listens on: a name that passes the check fails on connecting.
NOWHERE = create_engine("postgresql://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 1})


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
    assert tail == "\n".join(statements(["rides", "bill.charges:tenant"])) + "\n"
    assert "SELECT create_distributed_table('idempotency_keys', 'scope');" in tail
    # Citus needs the scope in processed_messages' key before it distributes the table.
    rekeyed = tail.index("PRIMARY KEY (consumer, message_id, scope);")
    assert rekeyed < tail.index("create_distributed_table('processed_messages'")
    assert (
        "SELECT create_distributed_table('bill.charges', 'tenant', "
        "colocate_with => 'idempotency_keys');" in tail
    )
    # The triggers that keep a phase in its scope and bind a new key's first phase to its
    # worker, after the distribution and in a transaction of their own (Citus allows them on
    # a distributed table when told).
    triggers = tail.split("BEGIN;\nSET LOCAL citus.enable_unsafe_triggers = on;\n")[1]
    assert "EXECUTE FUNCTION recoverypoint_stays_in_scope();\n" in triggers
    assert triggers.endswith("EXECUTE FUNCTION recoverypoint_binds_new_key();\nCOMMIT;\n")


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
    distributed = [s for s in statements([spec]) if "create_distributed_table" in s]
    assert f"'{table}', '{column}'" in distributed[-1]


@given(st.text())
def test_a_reference_table_is_a_plain_identifier_or_refused(name: str) -> None:
    """Refused before any database is asked (there is none here)."""
    try:
        distribute.make_reference(NOWHERE, [name])
    except ValueError as exc:
        assert "not a table name" in str(exc)
    except sa.exc.OperationalError:
        assert all(IDENTIFIER.fullmatch(part) for part in name.split("."))


def test_a_reference_table_needs_citus(db: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match="no citus extension"):
        distribute.make_reference(db, ["users"])
