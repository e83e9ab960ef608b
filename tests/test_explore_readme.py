"""docs/how-to/testing.md, "Prove your operation crash-safe": its subject, written as shown
next to an operation whose provider ignores idempotency keys, gives the report the page shows,
from the command line and from the pytest fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from docs_snippets import section

from recoverypoint.integrations.pytest_plugin import SERVER_URL_ENV

BLOCKS = [b.body for b in section("how-to/testing.md", "Prove your operation crash-safe")]

# The user's own operation, as the page supposes it: a provider (a table) that charges
# again for a key it has seen.
CHECKOUT = '''
import sqlalchemy as sa
import recoverypoint as rp
from recoverypoint.jobs import Job, consume_once

SCHEMA = """
CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                     key_id bigint NOT NULL, charge_id bigint);
CREATE TABLE charges (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                      idempotency_key text, amount integer NOT NULL);
CREATE TABLE receipts (job_key text NOT NULL);
"""
checkout = rp.Operation("checkout")
provider: list[sa.Engine] = []


@checkout.atomic_phase("order_created")
def create_order(tx, params):
    provider[:] = [tx.connection.engine]
    tx.state["order_id"] = tx.scalar(
        "INSERT INTO orders (key_id) VALUES (%s) RETURNING id", (tx.key_id,)
    )


@checkout.foreign_step("charged")
def charge(step, params):
    with provider[0].begin() as conn:
        charge_id = conn.scalar(
            sa.text("INSERT INTO charges (idempotency_key, amount) VALUES (:k, :a) RETURNING id"),
            {"k": step.downstream_key(), "a": params["amount"]},
        )
    return {"charge_id": charge_id}


@checkout.atomic_phase("finished")
def finish(tx, params):
    tx.execute(
        "UPDATE orders SET charge_id = %s WHERE id = %s",
        (tx.state["charge_id"], tx.state["order_id"]),
    )
    tx.stage_job("send_receipt", {})
    return rp.Response(201, {"order_id": tx.state["order_id"]})


def send_receipt(job: Job) -> None:
    with provider[0].begin() as conn:
        if consume_once(conn, "send_receipt", job.job_key):
            conn.execute(sa.text("INSERT INTO receipts VALUES (:k)"), {"k": job.job_key})
'''


def write_app(root: Path) -> None:
    (root / "myapp").mkdir()
    (root / "myapp" / "__init__.py").write_text("")
    (root / "myapp" / "checkout.py").write_text(CHECKOUT)
    subject = next(b for b in BLOCKS if b.startswith("# myapp/crash_safety.py"))
    (root / "myapp" / "crash_safety.py").write_text(subject)


def shown_lines(block: str) -> list[str]:
    """The report's lines the page shows whole: not those with a shortened key, the
    timing, or the hint, which the page wraps."""
    hint = ("why:", "provider acted twice", "key (see")
    return [
        line.strip()
        for line in block.splitlines()
        if line.strip() and "…" not in line and "s)" not in line and not line.startswith(hint)
    ]


def test_the_command_gives_the_report_shown(server_url: str, tmp_path: Path) -> None:
    write_app(tmp_path)
    command = next(b for b in BLOCKS if b.startswith("$ recoverypoint explore"))
    argv = command.removeprefix("$ ").split()
    argv[argv.index("--database-url") + 1] = server_url
    ran = subprocess.run(
        [sys.executable, "-m", "recoverypoint", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )

    assert ran.returncode == 1, ran.stdout + ran.stderr
    report = next(b for b in BLOCKS if b.startswith("crashes  schedules"))
    got = [line.strip() for line in ran.stdout.splitlines()]
    shown = shown_lines(report)
    assert len(shown) > 12
    for line in shown:
        assert line in got, f"{line!r} not in:\n{ran.stdout}"
    assert "the provider is where the guarantee ends" in ran.stdout


def test_the_fixture_fails_the_test_as_shown(server_url: str, tmp_path: Path) -> None:
    write_app(tmp_path)
    test = next(b for b in BLOCKS if "def test_checkout_is_crash_safe" in b)
    (tmp_path / "test_checkout.py").write_text(test)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_checkout.py"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        # The plugin's rp_server_url: the server the README's user names.
        env={**os.environ, "PYTHONPATH": str(tmp_path), SERVER_URL_ENV: server_url},
    )

    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "smallest failing schedule: client: attempt 1 raises at after_foreign:charged" in (
        ran.stdout
    )
