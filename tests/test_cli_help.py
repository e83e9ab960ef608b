"""Every command's ``--help``, as a terminal shows it: plain text, no reST markup, and true
of an installed package."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from recoverypoint.cli import build_parser


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
