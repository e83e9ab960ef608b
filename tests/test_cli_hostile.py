"""Hostile arguments to ``recoverypoint keys`` and ``jobs``: huge and negative numbers,
durations past any calendar, odd unicode, bytes the terminal could not decode, options
given twice. Whatever comes, the command ends with its status (2 usage, 3 not found, 4
refused, 0 done) and at most one line on stderr: never a traceback, never the driver's
"out of range", never status 1, which says the database failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from workload import plant_keys, stage_jobs

from recoverypoint import migrate
from recoverypoint.cli import main
from recoverypoint.database import create_engine
from recoverypoint.exits import EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, EXIT_USAGE

HOSTILE = settings(
    database=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
COMMANDS = [
    ["keys", "list"],
    ["keys", "show"],
    ["keys", "stats"],
    ["keys", "retry", "--dry-run"],
    ["keys", "release", "--dry-run"],
    ["keys", "abandon", "--dry-run"],
    ["keys", "reopen", "--dry-run"],
    ["keys", "delete", "--dry-run"],
    ["keys", "purge", "--dry-run"],
    ["jobs", "list"],
    ["jobs", "show"],
    ["jobs", "retry", "--dry-run"],
    ["jobs", "delete", "--dry-run"],
]
OPTIONS = [
    "--operation", "--version", "--scope", "--key", "--state", "--point", "--since", "--until",
    "--status", "--limit", "--stuck-after", "--older-than", "--response-status", "--message",
    "--name", "--key-id", "--reveal", "--json", "--force", "--abandoned", "--failing",
    "--reset-attempts", "--keep-attempts",
]  # fmt: skip
NUMBERS = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.sampled_from(["9" * 30, "9223372036854775808", "2147483648", "-0", "1e9", "0x10", "½"]),
)
DURATIONS = st.builds(
    lambda n, unit: f"{n}{unit}",
    st.one_of(st.integers(min_value=0, max_value=10**20), st.sampled_from(["1.5", ".5", "1e3"])),
    st.sampled_from(["", "s", "m", "h", "d", "y", "ms"]),
)
# What a terminal can hand a program: any text but NUL, and the lone surrogates Python
# makes of bytes that are not UTF-8.
TEXT = st.one_of(
    st.text(st.characters(blacklist_characters="\x00"), max_size=30),
    st.binary(min_size=1, max_size=12)
    .filter(lambda b: b"\x00" not in b)  # an argument ends at its first NUL
    .map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.sampled_from(["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00", "-1", " "]),
)
VALUES = st.one_of(NUMBERS, DURATIONS, TEXT)
ARGUMENTS = st.lists(st.one_of(st.sampled_from(OPTIONS), VALUES), max_size=8)


@pytest.fixture(scope="module")
def database(module_database_url: str) -> Iterator[str]:
    migrate.upgrade(module_database_url)
    db = create_engine(module_database_url)
    plant_keys(db, "charges", 5, point="reserved", next_attempt_at="now() - interval '1 hour'")
    stage_jobs(db, 3)
    db.dispose()
    yield module_database_url


def run(argv: list[str], database: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        status = main([*argv, "--database-url", database])
    except SystemExit as exit:  # argparse's own refusal
        status = int(exit.code or 0)
    err = capsys.readouterr().err
    return status, err


def assert_one_line(status: int, err: str) -> None:
    lines = [line for line in err.splitlines() if "event=" not in line]  # the audit trail
    assert status in (EXIT_OK, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REFUSED), (status, err)
    assert "Traceback" not in err and "out of range" not in err, err
    if status != EXIT_OK:
        assert len(lines) == 1 and ": error: " in lines[0], err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["keys", "list", "--since", "99999999999d"], EXIT_USAGE),
        (["keys", "purge", "--older-than", "99999999999999d", "--yes"], EXIT_USAGE),
        (["keys", "show", "99999999999999999999"], EXIT_USAGE),
        (["jobs", "show", "99999999999999999999"], EXIT_USAGE),
        (["keys", "list", "--stuck-after", "9" * 30 + "d"], EXIT_USAGE),
        (["keys", "retry", "9223372036854775808"], EXIT_USAGE),
        (["jobs", "list", "--key-id", "-5"], EXIT_USAGE),
        (["keys", "list", "--version", "2147483648"], EXIT_USAGE),
        (["keys", "list", "--status", "99999999999"], EXIT_USAGE),
        (["keys", "show", "9223372036854775807"], EXIT_NOT_FOUND),
        (["jobs", "show", "9223372036854775807"], EXIT_NOT_FOUND),
        (["keys", "list", "--since", "36500d", "--until", "9999-12-31T23:59:59-05:00"], EXIT_OK),
    ],
)
@pytest.mark.slow
def test_numbers_past_any_column_are_a_usage_error_in_one_line(
    argv: list[str], expected: int, database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(argv, database, capsys)
    assert_one_line(status, err)
    assert status == expected, err


@pytest.mark.slow
@HOSTILE
@given(command=st.sampled_from(COMMANDS), arguments=ARGUMENTS)
@example(command=["keys", "list"], arguments=["--since", "0001-01-01T00:00:00+05:00"])
@example(command=["keys", "list"], arguments=["--operation", "\udcff"])
@example(command=["keys", "abandon", "--dry-run"], arguments=["1", "--response-status", "600"])
@example(command=["jobs", "retry", "--dry-run"], arguments=["--limit", "9" * 20])
def test_every_argument_gets_a_status_and_one_line(
    command: list[str], arguments: list[str], database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run([*command, *arguments], database, capsys)
    assert_one_line(status, err)


@pytest.mark.slow
def test_a_usage_error_is_one_line_naming_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["keys", "show", "abc"])
    assert exit.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "recoverypoint keys show: error: argument id: not an id: 'abc'\n"
