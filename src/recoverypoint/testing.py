"""Fault injection at the engine's boundaries, for recoverypoint's tests and for yours.

A fault point is named ``<boundary>:<name>``:

==========================  ===========================================================
``before_commit:<point>``   an atomic phase ran; its transaction has not committed
``after_commit:<point>``    the phase (or a step's result) committed; nothing else ran
``before_foreign:<point>``  a foreign step is about to be called
``after_foreign:<point>``   the foreign step returned; its result is not yet committed
``after_publish:<job>``     the enqueuer published a job; its row is not yet deleted
==========================  ===========================================================

``<name>`` may be ``*`` for every point of that boundary. Each armed point fires with a
probability, and its effect is an exception (:class:`InjectedFault`) or an abrupt process
exit (``os._exit``, what SIGKILL or a power cut leaves behind: no ``finally``, no rollback
sent, the database sees the connection drop).

Switch faults on in code::

    from recoverypoint.testing import faults
    faults.arm("after_commit:ride_created", probability=1.0, effect="raise")

or for a whole process through the environment::

    RECOVERYPOINT_FAULTS="after_commit:ride_created=0.2,before_foreign:charge_created=0.1"
    RECOVERYPOINT_FAULT_EFFECT=exit      # or raise (the default)
    RECOVERYPOINT_FAULT_SEED=42          # repeatable runs

Faults are off by default; when off, each boundary costs one attribute read. Under pytest,
the ``rp_faults`` fixture (:mod:`recoverypoint.integrations.pytest_plugin`) is this
registry, disarmed before and after each test.

:func:`temporary_database` gives a test (or a demo run) an empty database of its own on a
server you run, and drops it afterwards.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.pool import NullPool

# The fault points live beside the engine that consults them; they are the kit's to offer.
from ._faults import BOUNDARIES, FAULT_EXIT_STATUS, Effect, Faults, InjectedFault, faults
from .database import create_engine, normalize_url

__all__ = [
    "BOUNDARIES",
    "FAULT_EXIT_STATUS",
    "Effect",
    "Faults",
    "InjectedFault",
    "faults",
    "temporary_database",
]


@contextmanager
def temporary_database(server_url: str, prefix: str = "rp_test") -> Iterator[str]:
    """Create an empty database ``<prefix>_<hex>`` on the server of ``server_url``, yield
    its URL (``postgresql+psycopg://``, password included), and drop it at the end.

    The database named in ``server_url`` is only used to create and drop the new one, so
    ``…/postgres`` will do; the role needs the CREATEDB privilege.
    """
    url = normalize_url(server_url)
    name = f"{prefix}_{secrets.token_hex(8)}"
    # CREATE/DROP DATABASE cannot run inside a transaction.
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                # FORCE: connections left behind (a killed process's) must not keep it.
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()
