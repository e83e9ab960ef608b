"""The API reference as mkdocstrings renders it (griffe, numpy style): every parameter a
docstring documents is shown with its own default, the one its signature gives."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import griffe

SOURCE = Path(__file__).parent.parent / "src"


def _functions(obj: griffe.Object | griffe.Alias) -> Iterator[griffe.Function]:
    if obj.is_alias:
        return
    if isinstance(obj, griffe.Function):
        yield obj
    for member in obj.members.values():
        yield from _functions(member)


def _documented_defaults(function: griffe.Function) -> Iterator[tuple[str, str, str]]:
    """(parameter, default shown, default in the signature) of each documented parameter;
    a class's parameters are documented on the class, an ``__init__``'s parent."""
    owner = function.parent if function.name == "__init__" else function
    docstring = owner.docstring if owner is not None else None
    if docstring is None:
        return
    for section in docstring.parse("numpy"):
        if section.kind is not griffe.DocstringSectionKind.parameters:
            continue
        for documented in section.value:
            if documented.name in function.parameters:
                signature = function.parameters[documented.name].default
                yield documented.name, str(documented.default), str(signature)


def test_each_documented_parameter_shows_its_own_default() -> None:
    package = griffe.load("recoverypoint", search_paths=[str(SOURCE)])
    wrong = [
        f"{function.path}({name}): shown {shown}, is {actual}"
        for function in _functions(package)
        for name, shown, actual in _documented_defaults(function)
        if shown != actual
    ]
    assert wrong == []
