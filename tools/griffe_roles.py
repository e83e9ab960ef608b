"""Docstrings are written with Sphinx's roles (:class:`~recoverypoint.Engine`), which read
well in the source and in help(); the site shows each as inline code (`Engine`)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([^`]+)`")


def _code(found: re.Match[str]) -> str:
    target = found.group(2)
    return f"`{target.rsplit('.', 1)[-1] if found.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
