"""Modules that moved, importable under their old names for one release, with a
:class:`DeprecationWarning` that says where they went.

The request path moved into :mod:`recoverypoint.engine`; its modules without a leading
underscore were importable by name before. (``recoverypoint.context`` keeps a module of its
own: phase code imports from it.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "recoverypoint.engine_async": "recoverypoint.engine.run_async",
    "recoverypoint.phase_guard": "recoverypoint.engine.phase_guard",
    "recoverypoint.sql": "recoverypoint.engine.sql",
    "recoverypoint.store": "recoverypoint.engine.store",
    "recoverypoint.store_async": "recoverypoint.engine.store_async",
}
"""Old module name → where it lives now."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old name with the module at its new one."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import the engines from recoverypoint",
            DeprecationWarning,
            stacklevel=2,  # the importing line: warnings skips the import machinery
        )
        module = importlib.import_module(new)
        # The import system is about to give the module the old name's spec, which its
        # own relative imports would then resolve against: kept, to be given back.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module at the new name ran when it was imported): its own
        spec is given back."""
        spec = module.__spec__
        if spec is not None and isinstance(spec.loader_state, importlib.machinery.ModuleSpec):
            module.__spec__ = spec.loader_state


def install() -> None:
    """Let the old names import (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
