"""``python -m recoverypoint``: the same as the ``recoverypoint`` command."""

from recoverypoint.cli import entry

raise SystemExit(entry())
