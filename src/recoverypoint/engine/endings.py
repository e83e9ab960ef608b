"""Whether SQL text ends the transaction it runs in, as PostgreSQL reads it.

A statement ends its transaction when it begins with ``COMMIT`` (``AND CHAIN`` included:
what follows is another transaction), ``END``, ``ABORT``, ``ROLLBACK`` (but not ``ROLLBACK
TO SAVEPOINT``) or ``PREPARE TRANSACTION``. Phase code may send several statements in one
string (psycopg sends a query without parameters, and Django's cursor any query, as one
simple query, which the server splits at each ``;``), and put comments anywhere between
words. So the text is read as the server reads it: quoted strings (``'...'``,
``E'...'``, ``$tag$...$tag$``), quoted identifiers and comments (``--``, ``/* */``, which
nest) hide what they hold, and a statement starts at the beginning and after each ``;``
outside them. The body of ``CREATE FUNCTION ... BEGIN ATOMIC ... END`` holds ``;`` of its
own, which psql's heuristic (kept here) tells apart.

Strings are read with ``standard_conforming_strings`` on, PostgreSQL's default since 9.1.
"""

from __future__ import annotations

import functools
import re

__all__ = ["ends_transaction"]

# The first word of each statement that may end a transaction.
_FIRST_WORDS = frozenset({"COMMIT", "END", "ABORT", "ROLLBACK", "PREPARE"})

_TOKEN = re.compile(
    r"""
      (?P<space> \s+ | --[^\n]* )
    | (?P<comment> /\* )
    | (?P<literal>
          (?<![\w$]) [Ee] ' (?: [^'\\] | \\. )* '?   # E'...', backslash escapes
        | ' [^']* '?                                  # '...' ('' is two of them, back to back)
        | " [^"]* "?                                  # "an identifier"
        | \$ (?P<tag> (?: [^\W\d] \w* )? ) \$ .*? (?: \$ (?P=tag) \$ | \Z )  # $$, $tag$
        | \$ \d+ | \d [\w.]*                          # $1, a number
      )
    | (?P<word> [^\W\d] [\w$]* )
    | (?P<end> ; )
    | (?P<other> . )
    """,
    re.VERBOSE | re.DOTALL,
)
_COMMENT = re.compile(r"/\*|\*/")

# Words read at the start of a statement: enough for ROLLBACK WORK TO, PREPARE TRANSACTION
# and CREATE OR REPLACE FUNCTION.
_LEADING = 4


def ends_transaction(text: str) -> bool:
    """Whether a statement of ``text`` ends the transaction it runs in."""
    return _ends_kept(text) if len(text) <= _KEPT_LENGTH else _reads_as_ending(text)


def _reads_as_ending(text: str) -> bool:
    if ";" not in text:  # one statement, most of a phase's: its first word mostly tells
        return _ends(_statements(text, whole=False)[0])
    upper = text.upper()
    if not any(word in upper for word in _FIRST_WORDS):
        return False
    return any(_ends(leading) for leading in _statements(text, whole=True))


# Phase code runs the same few statements again and again: the answer is kept for each
# text short enough to keep (a long one writes its values into the text).
_ends_kept = functools.lru_cache(maxsize=1024)(_reads_as_ending)
_KEPT_LENGTH = 2048


def _statements(text: str, *, whole: bool) -> list[list[str]]:
    """The leading words of each statement of ``text`` (``""`` for a token that is not a
    word); unless ``whole``, only the first statement's, and only as many as tell whether
    it ends a transaction."""
    statements: list[list[str]] = []
    leading: list[str] = []
    depth = 0  # BEGIN (ATOMIC) and CASE not yet closed by END, in a function's body
    pos, size = 0, len(text)
    while pos < size:
        token = _TOKEN.match(text, pos)
        assert token is not None  # `other` matches any character
        kind, pos = token.lastgroup, token.end()
        if kind == "space":
            continue
        if kind == "comment":
            pos = _comment_end(text, pos)
            continue
        if kind == "end" and depth == 0:
            statements.append(leading)
            leading = []
            continue
        word = token.group().upper() if kind == "word" else ""
        if len(leading) < _LEADING:
            leading.append(word)
            if not whole and (len(leading) == _LEADING or leading[0] not in _FIRST_WORDS):
                break
        elif _defines_function(leading):
            if word in ("BEGIN", "CASE"):
                depth += 1
            elif word == "END" and depth:
                depth -= 1
    statements.append(leading)
    return statements


def _comment_end(text: str, pos: int) -> int:
    """Where the comment whose ``/*`` ends at ``pos`` ends (comments nest)."""
    depth = 1
    for mark in _COMMENT.finditer(text, pos):
        depth += 1 if mark.group() == "/*" else -1
        if depth == 0:
            return mark.end()
    return len(text)


def _defines_function(leading: list[str]) -> bool:
    """psql's test for a statement whose body may hold ``;`` between BEGIN and END."""
    kind = leading[3:4] if leading[1:3] == ["OR", "REPLACE"] else leading[1:2]
    return leading[:1] == ["CREATE"] and kind in (["FUNCTION"], ["PROCEDURE"])


def _ends(leading: list[str]) -> bool:
    first, rest = (leading[0], leading[1:]) if leading else ("", [])
    if first in ("COMMIT", "END", "ABORT"):
        return True
    if first == "ROLLBACK":
        if rest[:1] in (["WORK"], ["TRANSACTION"]):
            rest = rest[1:]
        return rest[:1] != ["TO"]
    return first == "PREPARE" and rest[:1] == ["TRANSACTION"]
