"""Structured Field Values for HTTP (RFC 8941): the parser of an Item, as a pure function.

The IETF draft makes ``Idempotency-Key`` an Item whose value is a String; reading it takes
the whole Item grammar (§3.3), parameters included, parsed as §4.2 says. Nothing here knows
about keys; :func:`~recoverypoint.integrations._problem.read_key` decides what to accept.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from decimal import Decimal

__all__ = ["BareItem", "Item", "ParseError", "Token", "parse_item"]


class Token(str):
    """An sf-token (``abc``, ``*foo/bar``), told apart from an sf-string (``"abc"``)."""

    __slots__ = ()


BareItem = int | Decimal | str | bytes | bool  # str: a String, or a Token
Item = tuple[BareItem, dict[str, BareItem]]


class ParseError(ValueError):
    """The text is not a well-formed Item."""


# One pattern per bare item type (§3.3), each matched where the parser stands. Decimals
# first: a Decimal starts like an Integer.
_NUMBER = re.compile(r"-?(?:([0-9]{1,12}\.[0-9]{1,3})|([0-9]{1,15}))")
_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_STRING_ESCAPE = re.compile(r'\\(["\\])')
_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")
_BYTES = re.compile(r":([A-Za-z0-9+/=]*):")
_BOOLEAN = re.compile(r"\?([01])")
_KEY = re.compile(r"[a-z*][a-z0-9_\-.*]*")


def parse_item(text: str) -> Item:
    """The Item in ``text``, the value of one field (several lines joined with ``", "``):
    its bare item and its parameters, in order. Raises :class:`ParseError` unless all of
    ``text``, but for leading and trailing spaces, is one Item (RFC 8941 §4.2)."""
    if not text.isascii():
        raise ParseError("a structured field is ASCII text")
    parser = _Parser(text.lstrip(" "))
    item = parser.item()
    if parser.text[parser.at :].strip(" "):
        raise ParseError(f"unexpected {parser.text[parser.at :]!r:.40} after the item")
    return item


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def item(self) -> Item:
        return self.bare_item(), self.parameters()

    def bare_item(self) -> BareItem:
        for pattern, build in _BARE_ITEMS:
            found = pattern.match(self.text, self.at)
            if found is not None:
                self.at = found.end()
                return build(found)
        raise ParseError(f"no bare item at {self.text[self.at :]!r:.40}")

    def parameters(self) -> dict[str, BareItem]:
        params: dict[str, BareItem] = {}
        while self.text.startswith(";", self.at):
            self.at += 1
            while self.text.startswith(" ", self.at):
                self.at += 1
            found = _KEY.match(self.text, self.at)
            if found is None:
                raise ParseError(f"no parameter key at {self.text[self.at :]!r:.40}")
            self.at = found.end()
            value: BareItem = True
            if self.text.startswith("=", self.at):
                self.at += 1
                value = self.bare_item()
            params[found.group()] = value  # a repeated key keeps its last value
        return params


def _number(found: re.Match[str]) -> BareItem:
    return Decimal(found.group()) if found.group(1) else int(found.group())


def _bytes(found: re.Match[str]) -> bytes:
    content = found.group(1)
    try:
        # Padding may be left out (§4.2.7 says not to fail for that).
        return base64.b64decode(content + "=" * (-len(content) % 4), validate=True)
    except binascii.Error as exc:
        raise ParseError(f"not base64: {content!r:.40}") from exc


# Each starts with a character of its own, so the first pattern that matches is the type.
_BARE_ITEMS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], BareItem]], ...] = (
    (_NUMBER, _number),
    (_STRING, lambda found: _STRING_ESCAPE.sub(r"\1", found.group(1))),
    (_TOKEN, lambda found: Token(found.group())),
    (_BYTES, _bytes),
    (_BOOLEAN, lambda found: found.group(1) == "1"),
)
