"""The API reference as mkdocstrings renders it (griffe, numpy style, with mkdocs.yml's
extensions): every parameter a docstring documents is shown with its own default, the one
its signature gives, and a default written as a constant is shown as the constant's value."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import griffe
import yaml

ROOT = Path(__file__).parent.parent
SOURCE = ROOT / "src"


def _load() -> griffe.Module:
    """The package as the site's build loads it: with the extensions mkdocs.yml names."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (mkdocstrings,) = [p["mkdocstrings"] for p in config["plugins"] if "mkdocstrings" in p]
    names = mkdocstrings["handlers"]["python"]["options"]["extensions"]
    extensions = griffe.load_extensions(*(str(ROOT / name) for name in names))
    package = griffe.load("recoverypoint", search_paths=[str(SOURCE)], extensions=extensions)
    assert isinstance(package, griffe.Module)
    return package


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
    package = _load()
    wrong = [
        f"{function.path}({name}): shown {shown}, is {actual}"
        for function in _functions(package)
        for name, shown, actual in _documented_defaults(function)
        if shown != actual
    ]
    assert wrong == []


def test_a_default_written_as_a_constant_is_shown_as_its_value() -> None:
    # lock_timeout=DEFAULT_LOCK_TIMEOUT tells a reader nothing; timedelta(seconds=90) does.
    # What counts as a value is read from the running package, not from the extension's rule.
    shown_as_names = []
    for function in _functions(_load()):
        for parameter in function.parameters:
            default = parameter.default
            if not isinstance(default, griffe.ExprName):
                continue
            module, _, name = default.canonical_path.rpartition(".")
            if not module.startswith("recoverypoint"):
                continue
            value = getattr(importlib.import_module(module), name)
            if isinstance(value, (int, float, str, timedelta, tuple)):
                shown_as_names.append(f"{function.path}({parameter.name}={default})")
    assert shown_as_names == []
    operation = _load()["Operation.__init__"]
    assert str(operation.parameters["lock_timeout"].default) == "timedelta(seconds=90)"
