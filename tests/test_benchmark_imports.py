"""benchmarks/ run on their own, outside the suite, and import from each other: a name
renamed in one script broke another (``server_instructions.py`` asked ``instructions.py``
for a function it no longer had) and nothing noticed until the script was run. Read here
without running them (they need the bench extra, which the tests do not install): every
name a script takes from another, by ``from flows import X`` or ``import facts as
machine`` then ``machine.X``, is one that script defines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
MODULES = {path.stem: ast.parse(path.read_text()) for path in SCRIPTS}  # read once


def defined(module: ast.Module) -> set[str]:
    """The names ``module`` binds at its top level; ``*`` when it takes every name of
    another module, or answers any name (a module ``__getattr__``), which then passes."""
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add("*" if node.name == "__getattr__" else node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.With):
                targets = [item.optional_vars for item in node.items if item.optional_vars]
            else:
                targets = [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if isinstance(node, (ast.If, ast.Try, ast.For, ast.With)):  # what their bodies bind
            handled = [line for handler in getattr(node, "handlers", []) for line in handler.body]
            body = [
                *node.body,
                *getattr(node, "orelse", []),
                *getattr(node, "finalbody", []),
                *handled,
            ]
            names.update(defined(ast.Module(body=body, type_ignores=[])))
    return names


def taken(script: ast.Module, local: set[str]) -> set[tuple[str, str]]:
    """(module, name) for every name ``script`` takes from a benchmark module in ``local``."""
    wanted: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}
    for node in ast.walk(script):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in local:
            wanted.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in local:
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(script):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            wanted.add((aliases[node.value.id], node.attr))
    return wanted


def missing(script: ast.Module, modules: dict[str, ast.Module]) -> list[str]:
    """What ``script`` takes from one of ``modules`` that that module does not define."""
    gone = []
    for module, name in taken(script, set(modules)):
        names = defined(modules[module])
        if "*" not in names and name not in names:
            gone.append(f"{module}.{name}")
    return sorted(gone)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_what_a_script_imports_from_another_is_there(script: Path) -> None:
    gone = missing(MODULES[script.stem], MODULES)
    assert not gone, f"{script.name} takes what its module does not define: {gone}"


def test_the_check_sees_a_name_that_is_gone() -> None:
    # The break this file is for, as it was: the function renamed, the caller not; and a
    # name bound in a loop, a with block or a branch, which is there.
    modules = {
        "instructions": ast.parse("def require(tool): ...\nfor LOOP in (): ...\n"),
        "facts": ast.parse("if True:\n    def collect(): ...\nwith open('x') as HANDLE: ...\n"),
    }
    script = ast.parse(
        "from instructions import require_valgrind, require, LOOP\n"
        "import facts as machine\nmachine.gone()\nmachine.collect()\nmachine.HANDLE\n"
    )
    assert missing(script, modules) == ["facts.gone", "instructions.require_valgrind"]
