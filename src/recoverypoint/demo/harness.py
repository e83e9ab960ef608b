"""The demo's run, start to end: migrate, start the processes, drive the load, let the
completer and the enqueuer finish, stop everything, check.

The processes, each from the Rocket Rides example shipped in ``recoverypoint.demo.rocket_rides``:

- the fake payment provider, failing before and after charges at the mix's rates;
- ``api_processes`` API processes sharing one listening socket;
- one completer and one enqueuer (``recoverypoint worker``), the enqueuer with its own
  fault between publish and delete.

The provider and the API processes serve on listening sockets this process holds: when an
injected fault kills an API process, the others (and its replacement) accept the next
connections, and connections that arrive while none is up (a provider restarting, say)
wait in the socket's backlog instead of being refused.

Every group is supervised: whatever exits is started again.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ..database import create_engine
from .checks import check
from .faults import FaultMix
from .launcher import Launcher
from .load import Load, LoadResult
from .processes import Supervised, python_module, wait_until_serving
from .report import Report

WORKERS_APP = "recoverypoint.demo.rocket_rides.workers:engine"
ASYNC_WORKERS_APP = "recoverypoint.demo.rocket_rides.workers:async_engine"
_DECLINED_CUSTOMER = "cus_declined"  # the provider declines this customer's card

_UNSETTLED = sa.text(
    "SELECT (SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL), "
    "(SELECT count(*) FROM staged_jobs)"
)
_USERS = sa.text("SELECT email, customer_id = :declined FROM users ORDER BY id")


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 500
    concurrency: int = 8
    faults: FaultMix = field(default_factory=lambda: FaultMix.from_percent(20))
    seed: int = 0
    """Seeds the requests and every process's faults: the same run again, though timing
    (which request a fault hits first) still varies from run to run."""
    api_processes: int = 2
    lock_timeout: float = 5.0
    """Seconds a key stays locked by an API process that died holding it."""
    settle_timeout: float = 300.0
    """How long, after the load, the completer and enqueuer get to finish everything."""
    asynchronous: bool = False
    """Run the API's operation on ``rp.AsyncEngine`` (``api --async``), and the workers
    on that engine alone."""


@dataclass(frozen=True)
class Progress:
    stage: str
    """``prepare``, ``start``, ``load``, then ``completing`` while the workers finish what
    clients left, and ``check``; ``done`` and ``total`` count within ``load`` and
    ``completing``, the others are reported once, as they begin."""
    done: int
    total: int
    retries: int = 0
    api_restarts: int = 0
    unfinished: int = 0
    """Keys not finished and jobs not published yet (``completing``)."""


def run(
    config: DemoConfig,
    database_url: str,
    workdir: Path,
    *,
    progress: Callable[[Progress], None] = lambda progress: None,
    midway: Callable[[], None] | None = None,
) -> Report:
    """Run the demo on ``database_url`` (a database of its own: the checks count every
    row), with logs in ``workdir``; ``midway`` runs once when half the load is done."""
    # NullPool: no connection outlives a database restart.
    db = create_engine(database_url, poolclass=NullPool)
    try:
        progress(Progress("prepare", 0, 0))
        users = prepare(db)
        with ExitStack() as stack:
            progress(Progress("start", 0, 0))
            services = _start(config, database_url, workdir, stack)

            def on_done(done: int, result: LoadResult) -> None:
                restarts = services.groups["API"].restarts
                progress(Progress("load", done, config.requests, result.retries, restarts))

            load = Load(
                services.api_url,
                config.requests,
                config.concurrency,
                users,
                config.seed,
                on_done,
                midway,
            ).run()
            settle_seconds = _settle(db, config, progress)
            stack.close()  # every process stopped: what the database holds now is final
            progress(Progress("check", 0, 0))
            exits = {
                name: {
                    "faults": group.exits.faults,
                    "other": len(group.exits.other),
                    "restarts": group.restarts,
                }
                for name, group in services.groups.items()
            }
            checked = check(db, load, services.groups["enqueuer"].exits.fault_pids)
    finally:
        db.dispose()
    settings = {**asdict(config), "fault mix": config.faults.describe()}
    return Report(settings, load, checked, exits, settle_seconds)


@dataclass(frozen=True)
class _Services:
    api_url: str
    groups: dict[str, Supervised]
    """provider, API, completer, enqueuer."""


def prepare(db: sa.Engine) -> tuple[tuple[str, bool], ...]:
    """Create recoverypoint's and Rocket Rides' tables; return the users, as (email,
    whether the provider declines their card)."""
    migrated = subprocess.run(
        python_module(
            "recoverypoint.demo.rocket_rides",
            "migrate",
            "--database-url",
            db.url.render_as_string(hide_password=False),
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    if migrated.returncode != 0:
        raise RuntimeError(f"the Rocket Rides migration failed:\n{migrated.stderr}")
    with db.connect() as conn:
        rows = conn.execute(_USERS, {"declined": _DECLINED_CUSTOMER}).all()
    return tuple((email, bool(declined)) for email, declined in rows)


def _listening(stack: ExitStack) -> socket.socket:
    """A loopback socket on a port the kernel picks, listening, to be inherited."""
    listener = stack.enter_context(socket.socket())
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    listener.set_inheritable(True)
    return listener


def _start(config: DemoConfig, database_url: str, workdir: Path, stack: ExitStack) -> _Services:
    """Start the provider, the API processes and the workers; stopped with ``stack``."""
    faults, seed = config.faults, config.seed
    # Each server gets a socket already listening: a port merely found free could be taken
    # (by any process's outgoing connection) before the server binds it.
    provider_listener, listener = (_listening(stack) for _ in range(2))
    provider_url = f"http://127.0.0.1:{provider_listener.getsockname()[1]}"
    db = ("--database-url", database_url)
    no_faults = {"RECOVERYPOINT_FAULTS": ""}  # whatever this process's environment says

    def faulty(spec: str, salt: int) -> Callable[[int], dict[str, str]]:
        # A seed per group and per start: a restarted process must not draw the very
        # faults its predecessor died of, in the same order.
        return lambda start: {
            "RECOVERYPOINT_FAULTS": spec,
            "RECOVERYPOINT_FAULT_EFFECT": "exit",
            "RECOVERYPOINT_FAULT_SEED": str(seed * 100_003 + salt * 10_007 + start),
        }

    # Every process is forked from one that imported their modules once; it holds the
    # provider's and the API's listening sockets. Stopped after every group (LIFO stack).
    launcher = Launcher(
        log=workdir / "launcher.log", pass_fds=(provider_listener.fileno(), listener.fileno())
    )
    stack.callback(launcher.close)

    def group(
        name: str,
        command: Callable[[int], list[str]],
        env: Callable[[int], dict[str, str]],
        count: int = 1,
        keep_fds: tuple[int, ...] = (),
    ) -> Supervised:
        supervised = Supervised(
            name,
            command,
            launcher=launcher,
            cwd=workdir,
            log=workdir / f"{name}.log",
            env=env,
            count=count,
            keep_fds=keep_fds,
        )
        stack.callback(supervised.stop)
        return supervised

    provider = group(
        "provider",
        lambda start: [
            "recoverypoint.demo.rocket_rides",
            "provider",
            *db,
            "--fd",
            str(provider_listener.fileno()),
            "--fail-rate",
            str(faults.provider_before),
            "--fail-after-charge-rate",
            str(faults.provider_after),
            "--seed",
            str(seed + start),
        ],
        env=lambda start: no_faults,
        keep_fds=(provider_listener.fileno(),),
    )
    wait_until_serving(provider_url, provider)
    fd = listener.fileno()
    api = group(
        "API",
        lambda start: [
            "recoverypoint.demo.rocket_rides",
            "api",
            *db,
            "--provider-url",
            provider_url,
            "--lock-timeout",
            str(config.lock_timeout),
            "--fd",
            str(fd),
            *(["--async"] if config.asynchronous else []),
        ],
        env=faulty(faults.api_spec(), 1),
        count=config.api_processes,
        keep_fds=(fd,),
    )
    api_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    wait_until_serving(api_url, api)
    app = ASYNC_WORKERS_APP if config.asynchronous else WORKERS_APP
    worker_env = {
        "RECOVERYPOINT_DATABASE_URL": database_url,
        "ROCKET_RIDES_PROVIDER_URL": provider_url,
        "ROCKET_RIDES_LOCK_TIMEOUT": str(config.lock_timeout),
    }
    completer = group(
        "completer",
        lambda start: [
            "recoverypoint",
            "worker",
            "completer",
            "--app",
            app,
            "--min-age",
            "1",
            "--interval",
            "0.5",
        ],
        env=lambda start: {**worker_env, **no_faults},
    )
    enqueuer_faults = faulty(faults.enqueuer_spec(), 2)
    enqueuer = group(
        "enqueuer",
        lambda start: [
            "recoverypoint",
            "worker",
            "enqueuer",
            "--app",
            app,
            # Small batches: a crash re-publishes its whole batch.
            "--batch-size",
            "10",
            "--interval",
            "0.2",
        ],
        env=lambda start: {**worker_env, **enqueuer_faults(start)},
    )
    groups = {"provider": provider, "API": api, "completer": completer, "enqueuer": enqueuer}
    return _Services(api_url, groups)


def _settle(db: sa.Engine, config: DemoConfig, progress: Callable[[Progress], None]) -> float:
    """Wait until every key is finished and every job published, or the timeout."""
    began = time.monotonic()
    most = 0
    while time.monotonic() - began < config.settle_timeout:
        try:
            with db.connect() as conn:
                keys, jobs = conn.execute(_UNSETTLED).one()
        except DBAPIError:
            time.sleep(0.5)  # the database is restarting: ask again
            continue
        if keys + jobs == 0:
            break
        most = max(most, keys + jobs)
        progress(Progress("completing", most - keys - jobs, most, unfinished=keys + jobs))
        time.sleep(0.5)
    return time.monotonic() - began
