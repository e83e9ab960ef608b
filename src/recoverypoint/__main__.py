"""``python -m recoverypoint``: the same as the ``recoverypoint`` command."""

from recoverypoint.cli import command

raise SystemExit(command())
