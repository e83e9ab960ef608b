"""The facts of the machine a benchmark ran on, written beside its figures."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

PACKAGES = ("recoverypoint", "psycopg", "psycopg-binary", "SQLAlchemy", "dbos", "redis")
PG_SETTINGS = (
    "shared_buffers",
    "huge_pages",
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "wal_level",
    "max_wal_size",
    "max_connections",
    "default_transaction_isolation",
)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ram_gib() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return None


def os_name() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return platform.system()


def loadavg() -> str:
    return " ".join(_read("/proc/loadavg").split()[:3]) or "unknown"


def git_commit(repo: Path) -> str:
    """The commit of the checkout whose ``src/`` the measured recoverypoint was imported
    from (another worktree's, put first on ``PYTHONPATH`` to measure the code before a
    change, else ``repo``'s), and whether its src/ had uncommitted changes."""
    imported = importlib.util.find_spec("recoverypoint")
    if imported is not None and imported.origin is not None:
        checkout = Path(imported.origin).resolve().parents[2]
        if checkout != repo.resolve() and (checkout / "src").is_dir():
            return f"{git_commit_of(checkout)} (src/ of {checkout})"
    return git_commit_of(repo)


def git_commit_of(repo: Path) -> str:
    """``repo``'s commit, and whether its src/ had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    changed = [line for line in git("status", "--porcelain", "--", "src").splitlines() if line]
    if changed:
        return f"{commit} + uncommitted changes to {len(changed)} file(s) under src/"
    return commit


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def postgres(url: str) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()
        rows = conn.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)",
            (list(PG_SETTINGS),),
        ).fetchall()
    settings = {}
    for name, setting, unit in rows:
        settings[name] = _with_unit(setting, unit)
    return {
        "version": version[0] if version else "unknown",
        "settings": {name: settings.get(name, "?") for name in PG_SETTINGS},
    }


def _with_unit(setting: str, unit: str | None) -> str:
    """shared_buffers is reported in 8kB pages: show it in MB."""
    if unit == "8kB" and setting.isdigit():
        return f"{int(setting) * 8 // 1024}MB"
    if unit == "MB" and setting.isdigit():
        return f"{setting}MB"
    return setting if not unit else f"{setting} {unit}"


def collect(repo: Path, admin_url: str, redis_version: str | None) -> dict[str, Any]:
    ram = ram_gib()
    return {
        "date": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(ram, 1) if ram else None,
        "os": os_name(),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": package_versions(),
        "postgresql": postgres(admin_url),
        "redis": redis_version or "not measured",
        "git_commit": git_commit(repo),
        "loadavg_at_start": loadavg(),
    }


def markdown(facts: dict[str, Any]) -> list[str]:
    pg = facts["postgresql"]
    settings = ", ".join(f"{k}={v}" for k, v in pg["settings"].items())
    packages = ", ".join(f"{k} {v}" for k, v in facts["packages"].items())
    return [
        "| machine | |",
        "|---|---|",
        f"| date | {facts['date']} |",
        f"| git commit | {facts['git_commit']} |",
        f"| CPU | {facts['cpu_model']}, {facts['cpu_count']} logical CPUs "
        f"({facts['cpus_usable']} usable by this process) |",
        f"| RAM | {facts['ram_gib']} GiB |",
        f"| OS, kernel | {facts['os']}, Linux {facts['kernel']} |",
        f"| load average | {facts['loadavg_at_start']} at start, "
        f"{facts.get('loadavg_at_end', '?')} at end |",
        f"| PostgreSQL | {pg['version']} |",
        f"| PostgreSQL settings | {settings} |",
        f"| Redis | {facts['redis']} |",
        f"| Python | {facts['python']} |",
        f"| packages | {packages} |",
    ]
