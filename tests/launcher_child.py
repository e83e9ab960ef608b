"""What a test of ``recoverypoint.demo.launcher`` has a forked process do, by its first
argument: ``report`` (print, as one line of JSON, its arguments, its environment's
``LAUNCHER_*`` variables, the fault points armed and its working folder), ``exit N``
(``SystemExit(N)``), ``say TEXT`` (``SystemExit(TEXT)``), ``fault`` (the engine's fault
exit, ``os._exit``), ``raise``, ``sleep`` (say so, then sleep until killed)."""

from __future__ import annotations

import json
import os
import sys
import threading

from recoverypoint._faults import FAULT_EXIT_STATUS, faults

command, *rest = sys.argv[1:]
if command == "report":
    print(
        json.dumps(
            {
                "args": rest,
                "env": {k: v for k, v in os.environ.items() if k.startswith("LAUNCHER_")},
                "armed": sorted(faults._armed),
                "cwd": os.getcwd(),
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
