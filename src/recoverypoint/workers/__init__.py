"""The three workers, safe to run as many instances as you like side by side:

- :class:`Completer` finishes keys their clients left unfinished, and abandons those out
  of attempts;
- :class:`Reaper` deletes finished keys past their retention;
- :class:`Enqueuer` publishes staged jobs to the engine's job backend.

Each has ``run_once()`` (one pass, returning its counts) and ``run_forever()``; the
``recoverypoint worker`` command runs them.
"""

from ..engine import ABANDONED_RESPONSE
from .completer import Completer, CompleterResult
from .enqueuer import Enqueuer, EnqueuerResult
from .loop import Result, Worker, on_stop
from .reaper import Reaper, ReaperResult

__all__ = [
    "ABANDONED_RESPONSE",
    "Completer",
    "CompleterResult",
    "Enqueuer",
    "EnqueuerResult",
    "Reaper",
    "ReaperResult",
    "Result",
    "Worker",
    "on_stop",
]
