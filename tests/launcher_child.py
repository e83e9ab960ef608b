"""What a test of ``recoverypoint.demo.launcher`` has a forked process do, by its first
argument: ``report`` (print, as one line of JSON, its arguments, its environment's
``LAUNCHER_*`` variables, the fault points armed, its working folder and first import
path, and its descriptors above 2), ``exit N``
(``SystemExit(N)``), ``say TEXT`` (``SystemExit(TEXT)``), ``fault`` (the engine's fault
exit, ``os._exit``), ``raise``, ``sleep`` (say so, then sleep until killed)."""

from __future__ import annotations

import json
import os
import sys
import threading

from recoverypoint._faults import FAULT_EXIT_STATUS, faults


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


command, *rest = sys.argv[1:]
if command == "report":
    print(
        json.dumps(
            {
                "args": rest,
                "env": {k: v for k, v in os.environ.items() if k.startswith("LAUNCHER_")},
                "armed": sorted(faults._armed),
                "cwd": os.getcwd(),
                "path0": sys.path[0],
                "fds": [fd for fd in range(3, 64) if _open(fd)],
            }
        )
    )
elif command == "exit":
    raise SystemExit(int(rest[0]))
elif command == "say":
    raise SystemExit(rest[0])
elif command == "fault":
    os._exit(FAULT_EXIT_STATUS)
elif command == "raise":
    raise LookupError("raised in the forked process")
elif command == "sleep":
    print("sleeping", flush=True)
    threading.Event().wait()
