"""The "How the code is laid out" map (docs/contributing.md) matches the tree: every file and
folder it names exists, and every module and package of the library and of its request path
is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "recoverypoint"


def the_map() -> str:
    page = (ROOT / "docs" / "contributing.md").read_text()
    section = page.split("## How the code is laid out", 1)[1]
    return section.split("```text\n", 1)[1].split("```", 1)[0]


def named(text: str) -> set[str]:
    """The file and folder names in the map (``a.py``, ``admin/``, ``tools/x.py``)."""
    return set(re.findall(r"[\w/]+\.py\b|\b\w+/", text))


def listed(folder: Path) -> set[str]:
    """A folder's modules and packages, as the map writes them."""
    return {
        entry.name + ("/" if entry.is_dir() else "")
        for entry in folder.iterdir()
        if (entry.suffix == ".py" and entry.stem not in ("__init__", "__main__"))
        or (entry.is_dir() and (entry / "__init__.py").exists())
    }


def test_everything_the_map_names_exists() -> None:
    homes = [ROOT, ROOT / "src", PACKAGE, PACKAGE / "engine", PACKAGE / "engine" / "context"]
    missing = sorted(
        name for name in named(the_map()) if not any((home / name).exists() for home in homes)
    )
    assert not missing, f"the map names what is not there: {missing}"


def test_the_map_names_every_module_of_the_library_and_its_request_path() -> None:
    names = named(the_map())
    unnamed = sorted((listed(PACKAGE) | listed(PACKAGE / "engine")) - names)
    where = "'How the code is laid out' in docs/contributing.md"
    assert not unnamed, f"add these to {where}: {unnamed}"
