"""``python -m recoverypoint``: the same as the ``recoverypoint`` command."""

from recoverypoint.cli import main

raise SystemExit(main())
