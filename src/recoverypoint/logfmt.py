"""Log lines as ``key=value`` pairs (logfmt), one event each: what the workers and the
operator commands write, so one parser reads every line."""

from __future__ import annotations


def logfmt(**fields: object) -> str:
    """``key=value`` pairs on one line; values with spaces, quotes, ``=`` or line breaks
    are quoted and escaped."""
    parts = []
    for name, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\r\\'):
            text = '"' + text.translate(_ESCAPES) + '"'
        parts.append(f"{name}={text}")
    return " ".join(parts)


_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"})
