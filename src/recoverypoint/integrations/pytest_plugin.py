"""recoverypoint's pytest plugin (registered as ``pytest11``, so installing recoverypoint
is enough): the ``explore_crashes`` fixture runs :func:`recoverypoint.explore.explore`
and fails the test with its report, the smallest failing schedule first::

    def test_checkout_is_crash_safe(explore_crashes):
        explore_crashes(engine, checkout, {"amount": 2000}, check=one_charge, tables=["orders"])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..explore import Exploration, Subject, explore


@pytest.fixture
def explore_crashes() -> Callable[..., Exploration]:
    """``explore_crashes(engine, operation, params, **options)`` (or ``(subject,
    **options)``) explores every crash schedule and fails the test with the report when
    an invariant breaks; it returns the :class:`~recoverypoint.explore.Exploration`."""

    def run(*args: Any, **options: Any) -> Exploration:
        if args and isinstance(args[0], Subject):
            found = args[0].explore(*args[1:], **options)
        else:
            found = explore(*args, **options)
        if not found.ok:
            pytest.fail(found.report(), pytrace=False)
        return found

    return run
