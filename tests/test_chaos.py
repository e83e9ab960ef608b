"""Chaos: the ``recoverypoint demo`` harness (Rocket Rides as separate processes, killed and
failed at random while clients book rides) at several fault mixes, a PostgreSQL restart
among them, with every invariant asserted; and the checks themselves, shown to catch
planted violations.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from workload import alive, wait_for

from recoverypoint.database import create_engine
from recoverypoint.demo.checks import check
from recoverypoint.demo.faults import FaultMix
from recoverypoint.demo.harness import DemoConfig, Progress, prepare, run
from recoverypoint.demo.load import LoadResult, Sent
from recoverypoint.demo.progress import ProgressBar
from recoverypoint.demo.report import Report
from recoverypoint.embedded import embedded_server
from recoverypoint.keys import derived_key_of, record_material
from recoverypoint.testing import temporary_database

pytestmark = pytest.mark.slow  # the demo's processes under faults, tens of seconds each

REQUESTS = 80

MIXES = {
    # Often enough that leases are taken over and clients give up to the completer.
    "api-crashes": FaultMix(api_exit=0.03),
    "provider-and-enqueuer": FaultMix(provider_before=0.2, provider_after=0.2, enqueuer_exit=0.05),
    "everything-at-20%": FaultMix.from_percent(20),
}


class _TerminalLines:
    """A text stream whose lines go to pytest's terminal at once, each naming the test:
    a run takes a minute or more, which pytest would otherwise show as one silent dot."""

    def __init__(self, say: Callable[[str], None], name: str) -> None:
        self.say, self.name = say, name
        self.pending = ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.say(f"  {self.name}: {line.strip()}")
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.fixture
def progress(request: pytest.FixtureRequest, say: Callable[[str], None]) -> ProgressBar:
    """The run's progress, a line per stage and per quarter of the load."""
    return ProgressBar(_TerminalLines(say, request.node.name), steps=4)  # type: ignore[arg-type]


def assert_sound(report: Report) -> None:
    figures = report.figures()
    assert report.ok, report.table()
    assert figures["requests sent"] == REQUESTS
    accounted = ("finished by clients", "finished by the completer", "never accepted")
    assert sum(figures[name] for name in accounted) == REQUESTS, report.table()
    booked = figures["rides"] - figures["declined (402)"]
    assert figures["charges at the provider"] == booked, report.table()
    assert figures["receipts sent"] == booked, report.table()


def assert_workers_never_crashed(report: Report, workdir: Path) -> None:
    """The completer and the enqueuer ended only by an injected fault: each other exit of
    theirs was a start that found the database down (exit 1, in one line)."""
    for name in ("completer", "enqueuer"):
        log = (workdir / f"{name}.log").read_text()
        failed_starts = log.count("recoverypoint worker: error: ")
        assert report.process_exits[name]["other"] == failed_starts, report.process_exits
        assert "event=crashed" not in log
        assert not re.search("^Traceback", log, re.MULTILINE), log  # an uncaught exception


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_every_invariant_holds_under_faults(
    mix: FaultMix, server_url: str, tmp_path: Path, progress: ProgressBar
) -> None:
    config = DemoConfig(requests=REQUESTS, concurrency=6, faults=mix, seed=11)
    with temporary_database(server_url, prefix="rp_chaos") as url:
        report = run(config, url, tmp_path, progress=progress)

    assert_sound(report)
    figures = report.figures()
    assert figures["API processes killed"] > 0 or not mix.api_exit, report.table()
    assert figures["retries"] > 0, report.table()
    # The database stays up: no process ends but by an injected fault.
    assert figures["other process exits"] == 0, report.process_exits


def test_every_invariant_holds_with_the_api_on_asyncengine(
    server_url: str, tmp_path: Path, progress: ProgressBar
) -> None:
    """``api --async``: the operation's phases are ``async def`` on ``rp.AsyncEngine``, and
    the completer and the enqueuer take ``--app …workers:async_engine`` alone."""
    config = DemoConfig(
        requests=REQUESTS,
        concurrency=6,
        faults=MIXES["everything-at-20%"],
        seed=13,
        asynchronous=True,
    )
    with temporary_database(server_url, prefix="rp_chaos") as url:
        report = run(config, url, tmp_path, progress=progress)

    assert_sound(report)
    assert_workers_never_crashed(report, tmp_path)
    # Whether a client or the completer finishes a key left behind by a killed API
    # process depends on who comes first; tests/test_async_workers.py has the completer
    # finish async keys every time.
    assert report.figures()["other process exits"] == 0, report.process_exits


def test_every_invariant_holds_across_a_postgresql_restart(
    tmp_path: Path, progress: ProgressBar
) -> None:
    """A server of the test's own, crashed (immediate shutdown) and started again when
    half the rides are booked, with faults at 10% all along."""
    config = DemoConfig(requests=REQUESTS, concurrency=6, faults=FaultMix.from_percent(10), seed=5)
    restarts: list[float] = []
    completer_log = tmp_path / "completer.log"

    def completer_said(event: str) -> Callable[[], bool]:
        line = f"event={event} worker=completer "
        return lambda: completer_log.exists() and line in completer_log.read_text()

    with embedded_server() as server:

        def restart() -> None:
            # Events, not the clock: on a busy machine the completer may still be starting
            # when half the rides are booked (and a start that finds the server down exits,
            # to be started again), or not look at the database for seconds. So the crash
            # waits for a running completer, and the server stays down until it has seen
            # the outage.
            wait_for(completer_said("started"))
            server.restart(downtime=2.0, until=completer_said("database_unavailable"))
            restarts.append(2.0)

        report = run(config, server.url, tmp_path, progress=progress, midway=restart)

    assert restarts == [2.0]
    assert_sound(report)
    # The completer's passes failed while the server was down, said so once, and it lived
    # on to say the database was back.
    log = completer_log.read_text()
    assert log.count("event=database_unavailable worker=completer ") == 1, log
    assert "event=database_back worker=completer " in log, log
    assert_workers_never_crashed(report, tmp_path)


@pytest.mark.parametrize("engine", ["rp.Engine", "rp.AsyncEngine"])
def test_the_demo_command(engine: str, server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    command = [sys.executable, "-m", "recoverypoint", "demo", "--requests", "20"]
    command += ["--concurrency", "4", "--seed", "3", "--database-url", server_url]
    command += ["--async"] if engine == "rp.AsyncEngine" else []
    ran = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=300, check=False
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "every invariant holds" in ran.stdout
    assert "faults (20%): API process exits" in ran.stdout
    assert f"the API on {engine}\n" in ran.stdout
    written = json.loads(out.read_text())
    assert written["ok"] is True
    assert written["settings"]["asynchronous"] is (engine == "rp.AsyncEngine")
    assert written["figures"]["requests sent"] == 20
    assert written["settings"]["seed"] == 3
    assert all(inv["count"] == 0 for inv in written["invariants"].values())


@pytest.fixture
def rocket_rides_db(server_url: str) -> Iterator[sa.Engine]:
    with temporary_database(server_url, prefix="rp_chaos") as url:
        db = create_engine(url, poolclass=NullPool)
        prepare(db)
        yield db
        db.dispose()


def test_the_checks_catch_what_they_promise_to(rocket_rides_db: sa.Engine) -> None:
    """Rows no correct run leaves, planted: a ride charged twice, a charge for no ride, a
    receipt sent twice and one published twice by enqueuers that did not crash; and a
    client that was told 201 about a key that never finished."""
    with rocket_rides_db.begin() as conn:
        # The ride's request, its charge step called anew once past the provider's window:
        # two downstream keys, each of which charged.
        key = conn.execute(
            sa.text(
                "INSERT INTO idempotency_keys (scope, operation, idempotency_key, "
                "operation_version, request_method, request_path, request_params, fingerprint, "
                "window_renewals) SELECT id::text, 'create_ride', 'planted', 1, 'POST', '/rides', "
                "'{}', 'f', 1 FROM users LIMIT 1 "
                "RETURNING id, scope, created_at, operation, derivation_seed, generation"
            )
        ).one()
        ride = conn.execute(
            sa.text(
                "INSERT INTO rides (scope, idempotency_key_id, origin_lat, origin_lon, "
                "target_lat, target_lon, user_id) "
                "SELECT CAST(:s AS text), :k, 1, 1, 2, 2, CAST(:u AS bigint) "
                "RETURNING id"
            ),
            {"s": key.scope, "k": key.id, "u": int(key.scope)},
        ).scalar_one()
        material = record_material(
            key.derivation_seed, key.id, key.created_at, key.operation, key.generation
        )
        first = derived_key_of(material, "downstream", "charge_created", "")
        renewed = derived_key_of(material, "downstream", "charge_created", "", "1")
        conn.execute(
            sa.text(
                "INSERT INTO provider_charges (id, idempotency_key, amount, currency, customer) "
                "VALUES ('ch_1', :first, 2000, 'usd', 'c'), ('ch_2', :renewed, 2000, 'usd', 'c'), "
                "('ch_3', 'c', 2000, 'usd', 'c')"
            ),
            {"first": first, "renewed": renewed},
        )
        conn.execute(
            sa.text(
                # One receipt per user: two for the ride.
                "INSERT INTO receipts (job_key, ride_id, user_id, amount, currency) "
                "SELECT 'j', :r, id, 2000, 'usd' FROM users"
            ),
            {"r": ride},
        )
        conn.execute(
            sa.text(
                "INSERT INTO receipt_deliveries (job_key, enqueuer_pid) "
                "VALUES ('j', 1), ('j', 2), ('k', 3), ('k', 4)"
            )
        )
    told_201 = Sent("never-stored", "alice@example.com", 201, body={"ride_id": ride})

    checked = check(rocket_rides_db, LoadResult(sent=[told_201]), crashed_enqueuers={3})

    counts = {name: inv.count for name, inv in checked.invariants.items() if inv.count}
    assert counts == {
        "duplicate charges": 1,
        "rides without exactly one charge": 1,
        "charges without a ride": 1,
        "answers contradicting the database": 1,
        "receipts sent twice": 1,
        "receipts published twice": 1,  # 'j' twice by survivors; 'k' once after a crash
    }
    assert not checked.ok


def test_the_progress_names_each_stage_and_steps_through_the_load() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, steps=4)
    bar(Progress("prepare", 0, 0))
    bar(Progress("start", 0, 0))
    for done in range(1, 81):
        bar(Progress("load", done, 80, retries=done // 4))
    bar(Progress("completing", 0, 2, unfinished=2))
    bar(Progress("check", 0, 0))
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == [
        "prepare",
        "start",
        *["load"] * 5,
        "completing",
        "check",
    ]
    assert "80/80 rides  20 retries" in lines[-3]
    assert "checking the database" in lines[-1]


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """A process started meanwhile gets SIGINT as a terminal's foreground process does.

    A child inherits an ignored SIGINT (a non-interactive shell ignores it in what it runs
    in the background, as in `.ci/run &`), and a Python started with it ignored keeps it
    so: the Ctrl-C would never reach the demo. A handler is not inherited: the child gets
    the default, and Python its KeyboardInterrupt."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        state, parent = stat.rpartition(")")[2].split()[:2]
        if int(parent) == pid and state != "Z":
            found[int(entry.name)] = command
    return found


def test_a_ctrl_c_stops_the_demo_and_every_process_it_started(
    server_url: str, tmp_path: Path
) -> None:
    """The terminal's SIGINT goes to the demo's process group: the demo stops its processes
    (forked by its launcher, in a session of their own, which the SIGINT does not reach)
    and says where their logs are; none is left running."""
    command = [sys.executable, "-m", "recoverypoint", "demo", "--requests", "100000"]
    command += ["--concurrency", "2", "--database-url", server_url]
    with (tmp_path / "out").open("w") as out, _sigint_not_ignored():
        demo = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        launchers: list[int] = []

        def serving() -> bool:
            launchers[:] = [
                pid
                for pid, line in _children(demo.pid).items()
                if "recoverypoint.demo.launcher" in line
            ]
            # the provider, two API processes, the completer and the enqueuer
            return len(launchers) == 1 and len(_children(launchers[0])) == 5

        wait_for(serving)
        forked = list(_children(launchers[0]))

        os.killpg(demo.pid, signal.SIGINT)

        assert demo.wait(timeout=300) == 1
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    said = (tmp_path / "out").read_text()
    assert "recoverypoint demo: error: interrupted (logs in" in said, said
    assert "Traceback" not in said, said
    assert [pid for pid in [*launchers, *forked] if alive(pid)] == []
