"""docs/tutorial.md, followed word for word: its files are written as shown, its commands
run as shown (in a project directory whose ``.venv`` is this test run's virtualenv), the
servers it starts run in the background, and every line of output it shows is printed.

Three things differ from a reader's run, each for the test's isolation: the database is
a fresh one of this test (its name replaces ``shop`` in the URL and in ``createdb``; the
URL is exported as the page writes it, ``postgresql://``, and as hosting platforms hand
it out, ``postgres://``), the
API listens on a free port instead of 8000, and ids that differ by run (charge ids) are
compared as placeholders.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from docs_snippets import Block, blocks, page
from ports import free_port
from sqlalchemy.engine import make_url

from recoverypoint.database import create_engine
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # the tutorial's commands in a project of their own

DOC_URL = "postgresql://postgres@127.0.0.1:5432/shop"
DOC_PORT = "8000"
# A command whose output is still on its way (the enqueuer sends receipts every second)
# is run again until it prints what the page shows; past this many seconds it is wrong.
SETTLE = 120


def commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined."""
    return block.body.replace("\\\n", " ").strip().split("\n")


def normal(line: str) -> str:
    return re.sub(r"ch_[0-9a-f]{12}", "ch_<id>", line.strip())


@pytest.fixture(params=["postgresql", "postgres"])
def plain_server_url(server_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """``(url, name)`` of an empty database of this test: ``postgresql://`` as psql and
    the page write it, and ``postgres://`` as hosting platforms hand it out."""
    with temporary_database(server_url, prefix="rp_tutorial") as url:
        parsed = make_url(url)
        yield (
            parsed.set(drivername=request.param).render_as_string(hide_password=False),
            str(parsed.database),
        )


class Reader:
    """Runs the tutorial's commands as a reader at a shell would."""

    def __init__(self, project: Path, url: str, database: str) -> None:
        self.project = project
        self.url = url
        self.database = database
        self.port = str(free_port())
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERYPOINT_")}
        self.api: subprocess.Popen[str] | None = None
        self.background: list[subprocess.Popen[str]] = []
        self.output = ""
        self.last = ""

    def adapt(self, command: str) -> str:
        return (
            command.replace(DOC_URL, self.url)
            .replace(f"--port {DOC_PORT}", f"--port {self.port}")
            .replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{self.port}")
        )

    def run(self, command: str) -> None:
        self.last = command
        command = self.adapt(command)
        words = shlex.split(command)
        if words[:1] == ["createdb"]:
            # The test's database exists already: the command is the page's, the name ours.
            assert command == f"createdb -h 127.0.0.1 -U postgres {'shop'}", command
            return
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            self.env[name] = value
            return
        env = dict(self.env)
        while "=" in words[0]:  # VAR=value before the command
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[0] == ".venv/bin/uvicorn":
            self.stop_api()
            self.api = self.start(words, env)
            self.wait_for_api()
        elif words[:3] == [".venv/bin/recoverypoint", "worker", "all"]:
            self.background.append(self.start(words, env))
        else:
            done = subprocess.run(
                command, shell=True, cwd=self.project, env=env, capture_output=True, text=True,
                timeout=300,
            )  # fmt: skip
            self.output += done.stdout + done.stderr
            self.returncode = done.returncode

    def start(self, words: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            words, cwd=self.project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def wait_for_api(self) -> None:
        assert self.api is not None
        while self.api.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", int(self.port)), 1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"the API did not start: {self.api.stderr.read()}")  # type: ignore[union-attr]

    def stop_api(self) -> None:
        if self.api is not None:
            if self.api.poll() is None:
                self.api.send_signal(signal.SIGINT)  # Ctrl-C
            self.api.wait(timeout=60)
            self.api.stderr.close()  # type: ignore[union-attr]
            self.api = None

    def stop(self) -> None:
        self.stop_api()
        for process in self.background:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
            process.stderr.close()  # type: ignore[union-attr]


def test_the_tutorial_works_word_for_word(
    plain_server_url: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, database = plain_server_url
    project = tmp_path / "shop-service"
    project.mkdir()
    (project / ".venv").symlink_to(Path(sys.prefix))
    reader = Reader(project, url, database)
    ran: list[str] = []
    shown_outputs = 0
    try:
        for block in blocks(page("tutorial.md")):
            if block.mark == "not-run":
                continue
            assert block.mark == "test" and block.mark_value == "tests/test_docs_tutorial.py"
            if block.lang == "python":
                assert block.file_name, block.where
                target = project / block.file_name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.body)
            elif block.lang == "bash":
                reader.output = ""
                for command in commands(block):
                    reader.run(command)
                    ran.append(command)
                    if not command.startswith(("export", "createdb", ".venv/bin/uvicorn")) and (
                        "worker all" not in command
                    ):
                        failed = reader.returncode != 0
                        # curl's own failure is what the page shows after the crash.
                        assert not failed or command.startswith("curl"), (command, reader.output)
                    if "worker completer --once" in command:
                        # This pass, not the running workers' later one, finished the key.
                        assert unfinished_keys(url) == 0, reader.output
            else:
                shown_outputs += 1
                check_output(reader, block)
        # docs/how-to/http.md's retrying client, against the service the tutorial built.
        [client] = [
            b
            for b in blocks(page("how-to/http.md"))
            if b.mark_value == "tests/test_docs_tutorial.py"
        ]
        exec(compile(reader.adapt(client.body), client.where, "exec"), {"__name__": "client"})
        assert capsys.readouterr().out.startswith("201 {'charge_id': 'ch_")
        # Its schema shows the key, so a client generated from it sends one.
        schema = f"http://127.0.0.1:{reader.port}/openapi.json"
        with urllib.request.urlopen(schema, timeout=60) as answer:
            payments = json.load(answer)["paths"]["/payments"]["post"]
        assert {"name": "Idempotency-Key", "in": "header", "required": True}.items() <= next(
            p for p in payments["parameters"] if p["name"] == "Idempotency-Key"
        ).items()
        assert "409" in payments["responses"]
    finally:
        reader.stop()

    assert shown_outputs == 5
    assert any("worker completer --once --min-age 0" in c for c in ran)
    db = create_engine(url)
    try:
        with db.connect() as conn:
            paid = conn.execute(sa.text("SELECT order_id, charge_id FROM payments")).all()
            charges = conn.execute(sa.text("SELECT id FROM provider_charges")).scalars().all()
        assert sorted(o for o, _ in paid) == ["1001", "1002", "1003"]
        assert sorted(c for _, c in paid) == sorted(charges)  # one charge each, none extra
    finally:
        db.dispose()


def unfinished_keys(url: str) -> int:
    db = create_engine(url)
    try:
        with db.connect() as conn:
            query = "SELECT count(*) FROM idempotency_keys WHERE response_status IS NULL"
            return int(conn.execute(sa.text(query)).scalar_one())
    finally:
        db.dispose()


def check_output(reader: Reader, block: Block) -> None:
    """Every line the page shows is printed by the command before it (set apart from the
    others by the run's ids); a count still on its way is asked again."""
    shown = [normal(line) for line in block.body.strip().split("\n") if line.strip()]
    deadline = time.monotonic() + SETTLE
    while True:
        printed = [normal(line) for line in reader.output.replace("\r", "").split("\n")]
        missing = [line for line in shown if line not in printed]
        replayed = sum(line == "idempotent-replayed: true" for line in printed)
        if not missing and replayed == shown.count("idempotent-replayed: true"):
            return
        if not reader.last.startswith("psql") or time.monotonic() > deadline:
            raise AssertionError(f"after {reader.last!r}, not printed: {missing}\n{reader.output}")
        time.sleep(0.2)
        reader.output = ""
        reader.run(reader.last)
