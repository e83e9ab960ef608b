"""``recoverypoint.demo.launcher``: the demo's processes forked from one that imported their
modules once. Each runs as ``python -m`` would run its module, with its own environment
(its faults armed from it, not from the launcher's), arguments, folder and log, and ends
with the status a new interpreter would have; the launcher kills what still runs when it
is closed, and a start after it died is an error that says where its log is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import alive, wait_for

from recoverypoint.demo.launcher import Forked, Launcher
from recoverypoint.testing import FAULT_EXIT_STATUS

pytestmark = pytest.mark.slow  # a launcher process per test, its imports a second or two

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """A launcher whose own environment arms a fault point and has a variable of its own,
    to show that neither reaches what it forks."""
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved.get("PYTHONPATH")]))
    os.environ["RECOVERYPOINT_FAULTS"] = "before_commit:launcher=1"
    os.environ["LAUNCHER_OWN"] = "the launcher's"
    try:
        started = Launcher(log=tmp_path_factory.mktemp("launcher") / "launcher.log")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield started
    started.close()


def run(
    launcher: Launcher,
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    keep_fds: list[int] | None = None,
) -> tuple[int, str]:
    log = tmp_path / "child.log"
    log.unlink(missing_ok=True)
    process = launcher.start(
        "launcher_child", args, env=env or {}, cwd=tmp_path, log=log, keep_fds=keep_fds or []
    )
    status = process.wait(timeout=60)
    return status, log.read_text() if log.exists() else ""


def test_each_process_has_its_own_environment_faults_arguments_and_folder(
    launcher: Launcher, tmp_path: Path
) -> None:
    env = {"LAUNCHER_MINE": "é\u2028", "RECOVERYPOINT_FAULTS": "after_commit:mine=0.5"}
    env |= {"RECOVERYPOINT_FAULT_EFFECT": "exit"}
    status, out = run(launcher, tmp_path, "report", "a b", "", env=env)

    assert status == 0, out
    report = json.loads(out)
    assert report["args"] == ["a b", ""]
    assert report["env"] == {"LAUNCHER_MINE": "é\u2028"}  # not LAUNCHER_OWN
    assert report["armed"] == ["after_commit:mine"]  # not the launcher's before_commit point
    assert report["cwd"] == report["path0"] == str(tmp_path)

    status, out = run(launcher, tmp_path, "report", env={})
    assert json.loads(out)["armed"] == []


@pytest.mark.parametrize(
    ("args", "status", "said"),
    [
        (["exit", "0"], 0, ""),
        (["exit", "3"], 3, ""),
        (["say", "no such thing"], 1, "no such thing\n"),
        (["fault"], FAULT_EXIT_STATUS, ""),
        (["raise"], 1, "LookupError: raised in the forked process"),
    ],
    ids=["exit 0", "exit 3", "exit with a message", "injected fault", "uncaught exception"],
)
def test_the_exit_status_is_a_new_interpreter_s(
    launcher: Launcher, tmp_path: Path, args: list[str], status: int, said: str
) -> None:
    ended, out = run(launcher, tmp_path, *args)

    assert ended == status, out
    assert said in out


def test_a_signal_ends_it_as_it_ends_any_process(launcher: Launcher, tmp_path: Path) -> None:
    process = sleeping(launcher, tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)

    process.kill()

    assert process.wait(timeout=60) == -signal.SIGKILL
    assert process.poll() == -signal.SIGKILL
    process.terminate()  # ended: nothing to signal, no error


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")), max_size=4
    ),
    value=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=50
    ),
)
def test_any_arguments_and_environment_arrive_as_sent(
    launcher: Launcher, tmp_path: Path, args: list[str], value: str
) -> None:
    status, out = run(launcher, tmp_path, "report", *args, env={"LAUNCHER_VALUE": value})

    assert status == 0, out
    report = json.loads(out)
    assert report["args"] == args
    assert report["env"] == {"LAUNCHER_VALUE": value}


def test_an_environment_with_a_nul_fails_that_process_alone(
    launcher: Launcher, tmp_path: Path
) -> None:
    status, out = run(launcher, tmp_path, "report", env={"LAUNCHER_BAD": "a\0b"})

    assert status == 1
    assert "embedded null byte" in out
    assert run(launcher, tmp_path, "exit", "0")[0] == 0  # the launcher goes on


def test_closing_kills_what_still_runs_and_refuses_starts_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    own = Launcher(log=tmp_path / "launcher.log")
    help_log = tmp_path / "help.log"
    process = own.start("recoverypoint", ["worker", "--help"], env={}, cwd=tmp_path, log=help_log)
    assert process.wait(timeout=60) == 0
    assert "completer" in help_log.read_text()
    sleeper = sleeping(own, tmp_path)

    own.close()

    assert not alive(sleeper.pid)
    assert sleeper.poll() == -signal.SIGKILL
    with pytest.raises(RuntimeError, match=r"no more orders; its log: .*launcher\.log"):
        own.start("recoverypoint", ["--version"], env={}, cwd=tmp_path, log=tmp_path / "v.log")


def test_a_process_keeps_the_descriptors_it_is_given_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    read, write = os.pipe()
    try:
        own = Launcher(log=tmp_path / "launcher.log", pass_fds=(read, write))
        try:
            _, kept = run(own, tmp_path, "report", keep_fds=[write])
            _, none = run(own, tmp_path, "report")
        finally:
            own.close()
    finally:
        os.close(read)
        os.close(write)

    assert json.loads(kept)["fds"] == [write]
    assert json.loads(none)["fds"] == []


def sleeping(launcher: Launcher, tmp_path: Path) -> Forked:
    log = tmp_path / "sleeper.log"
    sleeper = launcher.start("launcher_child", ["sleep"], env={}, cwd=tmp_path, log=log)
    wait_for(lambda: log.exists() and "sleeping" in log.read_text())
    assert sleeper.poll() is None
    return sleeper


def test_a_killed_launcher_leaves_nothing_running_and_refuses_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    own = Launcher(log=tmp_path / "launcher.log")
    env: dict[str, str] = {}
    sleeper = sleeping(own, tmp_path)

    own._process.kill()  # as the OOM killer would

    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    wait_for(lambda: not alive(sleeper.pid))  # killed, not left running as an orphan
    with pytest.raises(RuntimeError, match=r"launcher\.log"):
        own.start("launcher_child", ["exit", "0"], env=env, cwd=tmp_path, log=tmp_path / "e.log")
    own.close()


def test_closing_reports_what_it_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    own = Launcher(log=tmp_path / "launcher.log")
    sleeper = sleeping(own, tmp_path)

    own.close()

    assert sleeper.poll() == -signal.SIGKILL
