"""The import contract (README: "How the code is laid out"), read from the source with
``ast``: layers import only downward, nothing imports the CLI, and no module imports itself
in a circle.

Layers, lowest first (a module may import its own layer and those below):

0. pure rules and declarations: errors, keys, operation, exits, logfmt, backoff, schema,
   observe (the hooks every layer calls), leases (the lease rule, in SQL and Python),
   generations (the rule of a key's generation, in SQL), running (when a worker is
   running, and what the running completers can finish, in SQL),
   _faults (the fault points the engine consults), and the request path's pure parts
   (engine._decide; engine.endings, which SQL ends a transaction)
1. plumbing: database, outage, migrate, testing (the kit users test with, which offers
   _faults), embedded, jobs
2. the connection and the request path's queries, in the engine package: engine._pg,
   engine._libpq, engine._waiter (the async connection's wait), engine.sql, engine.store,
   engine.heartbeat (a running step's lease, renewed), engine.phase_guard, engine.context
   (what a phase receives wraps the connection); _pooler; and context, the old name of
   engine.context
3. the engine (engine.run, engine.run_async and the package's ``__init__``), the
   package's curated ``__init__``, and _moved (the request path's old module names)
4. services on the engine: admin, workers, integrations, client, explore (which runs the
   workers) and _failover (what explore's failover loses and puts back) — and admin,
   which the workers and the console will use, imports none of them
5. the demo
6. the CLI and the console; only ``__main__`` imports the CLI, and Django's
   ``manage.py recoverypoint``, which is the CLI with Django set up

The request path is one package, ``engine``, whose modules sit on three layers: each of them
is placed here by name (``engine.<module>``), as a top-level module is.
A new module must be placed here: the test names it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "recoverypoint"

LAYERS = {
    **dict.fromkeys(
        [
            "errors",
            "keys",
            "operation",
            "exits",
            "logfmt",
            "backoff",
            "schema",
            "engine._decide",
            "engine.conflicts",
            "engine.waits",
            "engine.endings",
            "observe",
            "leases",
            "generations",
            "running",
            "_faults",
        ],
        0,
    ),
    **dict.fromkeys(
        ["database", "outage", "migrate", "distribute", "testing", "embedded", "jobs"], 1
    ),
    **dict.fromkeys(
        [
            "engine._pg",
            "engine._pg_async",
            "engine._libpq",
            "engine._libpq_async",
            "engine._waiter",
            "_pooler",
            "engine.store",
            "engine.store_async",
            "engine.heartbeat",
            "engine.sql",
            "engine.phase_guard",
            "engine.context",
            "engine.listen",
            "engine.listen_async",
            "context",
        ],
        2,
    ),
    # _moved imports the request path's modules by name, at run time, when an old name is.
    **dict.fromkeys(
        [PACKAGE, "engine", "engine.run", "engine.run_async", "idempotent", "_moved"], 3
    ),
    **dict.fromkeys(["admin", "workers", "integrations", "client", "explore", "_failover"], 4),
    "demo": 5,
    **dict.fromkeys(["cli", "console", "integrations.django.management"], 6),
    "__main__": 7,
}
# Packages whose modules are placed one by one (``engine.sql``), not as one family.
SPLIT = {"engine"}
# Same layer, yet one way only: the workers and the console build on admin. And the
# admin layer's SQL fragments are its own: what the workers share with it is in leases.
# The request path and the workers consult the fault points (_faults), never the test kit.
FORBIDDEN = {
    "admin": {"workers", "integrations", "client", "demo", "cli", "console"},
    "workers": {"admin._sql", "testing"},
    **{
        f"engine.{name}": {"testing"}
        for name in ("run", "run_async", "store", "store_async", "heartbeat")
    },
}


def module_names() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = module_names()


def imports(name: str, path: Path) -> set[str]:
    """The recoverypoint modules ``name`` imports (``from pkg import sub`` counts as sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports: read when a test asks (parsing every module is most of a
    second, which each test process would otherwise spend collecting)."""
    return {name: imports(name, path) for name, path in MODULES.items()}


def family(module: str) -> str:
    """The name ``module`` is placed under in LAYERS: its top-level module or package; for a
    package in SPLIT, the package's own module or subpackage (``engine.context``); or a
    subpackage placed on its own (``integrations.django.management``)."""
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE
    for depth in range(len(parts), 1, -1):
        if ".".join(parts[:depth]) in LAYERS:
            return ".".join(parts[:depth])
    if parts[0] in SPLIT and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def forbidden(mine: str, target: str) -> bool:
    """Whether FORBIDDEN keeps family ``mine`` from importing module ``target``: one of its
    families, or the module itself or a package holding it."""
    name = target.removeprefix(PACKAGE + ".")
    return any(
        family(target) == banned or name == banned or name.startswith(banned + ".")
        for banned in FORBIDDEN.get(mine, ())
    )


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({family(m) for m in MODULES} - set(LAYERS))
    assert not unplaced, f"place these in tests/test_layers.py's LAYERS: {unplaced}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module: str) -> None:
    mine = family(module)
    upward = [
        target
        for target in sorted(graph()[module])
        if LAYERS.get(family(target), 99) > LAYERS.get(mine, -1) or forbidden(mine, target)
    ]
    assert not upward, f"{module} (layer {LAYERS.get(mine)}) imports upward: {upward}"


def test_nothing_imports_the_cli_but_main() -> None:
    importers = sorted(
        name
        for name, targets in graph().items()
        if family(name) != "cli" and any(family(t) == "cli" for t in targets)
    )
    assert importers == [
        f"{PACKAGE}.__main__",
        f"{PACKAGE}.integrations.django.management.commands.recoverypoint",
    ]


def test_there_are_no_import_cycles() -> None:
    # Depth-first search; a back edge is a cycle.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph().get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for module in sorted(graph()):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
