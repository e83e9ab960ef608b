"""Defaults are written as named constants (``lock_timeout=DEFAULT_LOCK_TIMEOUT``), so that a
value is defined once; the site shows the value itself (``timedelta(seconds=90)``), which is
what a reader of the reference wants to know. A constant whose value is an object, not a
literal (``NO_OBSERVER``), keeps its name: the name says more than ``Observer()``."""

from __future__ import annotations

from typing import Any

import griffe

# The only call a shown value may hold: durations are written as timedelta(...).
_CALLS = {"timedelta"}


class ConstantDefaults(griffe.Extension):
    def on_function(self, *, func: griffe.Function, **kwargs: Any) -> None:
        # Called once the whole package is loaded: a constant of any module resolves.
        for parameter in func.parameters:
            value = _literal_value(parameter.default, func.package)
            if value is not None:
                parameter.default = value


def _literal_value(default: Any, pkg: griffe.Module) -> str | griffe.Expr | None:
    """The value of the package's constant that ``default`` names, if it is a literal (a
    string, a number, a tuple of them, arithmetic on them, a ``timedelta``); else None."""
    if not isinstance(default, griffe.ExprName):
        return None
    path = default.canonical_path
    if not path.startswith(f"{pkg.name}."):
        return None
    try:
        constant = pkg.modules_collection.get_member(path)
        if constant.is_alias:
            constant = constant.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if not isinstance(constant, griffe.Attribute) or constant.value is None:
        return None
    value = constant.value
    if isinstance(value, griffe.Expr):
        names = {str(part) for part in value.iterate() if isinstance(part, griffe.ExprName)}
        if not names <= _CALLS:
            return None
    return value
