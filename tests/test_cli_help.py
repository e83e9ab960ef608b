"""Every command's ``--help``, as a terminal shows it: plain text, no reST markup, and true
of an installed package."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from recoverypoint.cli import build_parser, main
from recoverypoint.exits import EXIT_USAGE


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield from commands(sub)


HELPS = {parser.prog: parser.format_help() for parser in commands(build_parser())}


def test_every_command_is_walked() -> None:
    assert {"recoverypoint metrics serve", "recoverypoint console", "recoverypoint demo"} <= set(
        HELPS
    )


@pytest.mark.parametrize("prog", sorted(HELPS))
def test_help_is_plain_text(prog: str) -> None:
    text = HELPS[prog]
    assert "``" not in text
    assert not re.search(r":(mod|func|class|meth|data):`", text)


def test_the_demo_needs_the_extra_not_a_checkout() -> None:
    text = " ".join(HELPS["recoverypoint demo"].split())
    assert "checkout" not in text
    assert "pip install 'recoverypoint[demo]'" in text


def test_no_command_completes_an_abbreviated_option() -> None:
    assert [parser.prog for parser in commands(build_parser()) if parser.allow_abbrev] == []


KEYS_LIST = next(p for p in commands(build_parser()) if p.prog == "recoverypoint keys list")
LONG_OPTIONS = sorted(
    option
    for action in KEYS_LIST._actions
    for option in action.option_strings
    if option.startswith("--")
)


@settings(
    database=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(option=st.sampled_from(LONG_OPTIONS), cut=st.integers(min_value=1, max_value=20))
def test_an_abbreviated_option_is_a_usage_error_before_anything_runs(
    option: str, cut: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--scop`` is not ``--scope``: refused in one line, before any database is asked
    (the URL here names no server)."""
    prefix = option[: max(3, len(option) - cut)]
    assume(prefix not in LONG_OPTIONS)
    argv = ["keys", "list", prefix, "x", "--database-url", "postgresql://nowhere.invalid/db"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unrecognized arguments: {prefix}" in err, err
