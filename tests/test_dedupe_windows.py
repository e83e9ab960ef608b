"""A provider's dedupe window, on real PostgreSQL, with both engines: a charge whose answer
was lost and whose key is resumed after the provider forgot the downstream key (by the
client, the completer, or the completer after an operator's ``keys retry``) is never
charged blindly again. Without a reconcile hook the key is held for an operator; with one,
the hook's answer is recorded, or the step is called anew with a fresh downstream key.

The operator's commands are those of docs/how-to/operating.md ("When a key needs
reconciliation"). "25 hours later" is made by moving the key's timestamps back in SQL,
never by sleeping."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.cli import main
from recoverypoint.database import normalize_url
from recoverypoint.exits import EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from recoverypoint.integrations.prometheus_collector import DatabaseCollector
from recoverypoint.workers import Completer

REQUEST = rp.Request("POST", "/rides")
WINDOW = timedelta(hours=24)
LATER = timedelta(hours=25)


@dataclass
class Provider:
    """A payment provider that remembers idempotency keys for a window: a fake of the
    foreign system. ``forget()`` is its window passing; its charges stay, and ``find``
    looks them up by the key they were made with, as an operator's search would."""

    remembered: dict[str, str] = field(default_factory=dict)
    charges: list[tuple[str, str]] = field(default_factory=list)
    """(charge id, downstream key), in the order made."""
    calls: list[str] = field(default_factory=list)
    """The downstream key of every call."""
    lookups: list[str] = field(default_factory=list)
    fail: list[str] = field(default_factory=list)
    """What each next call does wrong: ``lose`` (charges, then the answer is lost) or
    ``down`` (charges nothing)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def charge(self, key: str) -> dict[str, str]:
        with self.lock:
            self.calls.append(key)
            failure = self.fail.pop(0) if self.fail else None
            if failure == "down":
                raise rp.Retryable("the provider is down")
            if key not in self.remembered:
                self.remembered[key] = f"ch_{len(self.charges) + 1}"
                self.charges.append((self.remembered[key], key))
            if failure == "lose":
                raise rp.Retryable("the provider's answer was lost")
            return {"charge_id": self.remembered[key]}

    def forget(self) -> None:
        self.remembered.clear()

    def find(self, key: str) -> Any:
        self.lookups.append(key)
        for charge_id, made_with in self.charges:
            if made_with == key:
                return {"charge_id": charge_id}
        return rp.NotFound


def declare(provider: Provider, asynchronous: bool, hook: bool) -> rp.Operation[Any]:
    """create_ride: an atomic phase, a charge with a 24 h window, the answer."""
    # Named apart: the tests share a database, and the metrics count by operation.
    rides = rp.Operation(f"ride_{uuid.uuid4().hex[:12]}", max_attempts=3)

    def created(tx: Any, params: Any) -> None:
        tx.state["ride"] = params["ride"]

    def charge(step: rp.StepContext, params: Any) -> dict[str, str]:
        return provider.charge(step.downstream_key())

    def reconcile(step: rp.StepContext, params: Any) -> Any:
        return provider.find(step.downstream_key())

    def finish(tx: Any, params: Any) -> rp.Response:
        return rp.Response(201, {"charge": tx.state["charge_id"]})

    if asynchronous:
        created, charge, reconcile, finish = (
            _async(f) for f in (created, charge, reconcile, finish)
        )
    rides.atomic_phase("ride_created")(created)
    window: dict[str, Any] = {"dedupe_window": WINDOW}
    if hook:
        window["reconcile"] = reconcile
    rides.foreign_step("charge_created", **window)(charge)
    rides.atomic_phase("finished")(finish)
    return rides


def _async(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(*args: Any) -> Any:
        return fn(*args)

    return wrapped


class Service:
    """One engine, sync or async, called the same way."""

    def __init__(self, engine: rp.Engine | rp.AsyncEngine, operation: rp.Operation[Any]) -> None:
        self.engine = engine
        self.operation = operation
        self.scope = uuid.uuid4().hex  # the tests share a database
        engine.register(operation)

    def run(self, key: str) -> rp.Outcome:
        call = self.engine.run(
            self.operation, key=key, params={"ride": 7}, scope=self.scope, request=REQUEST
        )
        return asyncio.run(call) if isinstance(self.engine, rp.AsyncEngine) else call  # type: ignore[arg-type]

    def resume(self, key: str) -> rp.Outcome:
        call = self.engine.resume(self.key_id(key))
        return asyncio.run(call) if isinstance(self.engine, rp.AsyncEngine) else call  # type: ignore[arg-type]

    def key_id(self, key: str) -> int:
        with self.engine.db.connect() as conn:
            return int(
                conn.execute(
                    sa.text(
                        "SELECT id FROM idempotency_keys WHERE idempotency_key = :k AND scope = :s"
                    ),
                    {"k": key, "s": self.scope},
                ).scalar_one()
            )

    def row(self, key: str) -> Any:
        with self.engine.db.connect() as conn:
            return conn.execute(
                sa.text("SELECT * FROM idempotency_keys WHERE idempotency_key = :k AND scope = :s"),
                {"k": key, "s": self.scope},
            ).one()

    def later(self, key: str, by: timedelta = LATER) -> None:
        """The key as it stands ``by`` later: every time it holds moved back."""
        with self.engine.db.begin() as conn:
            conn.execute(
                sa.text(
                    """
                    UPDATE idempotency_keys
                    SET created_at = created_at - :by, last_run_at = last_run_at - :by,
                        next_attempt_at = next_attempt_at - :by,
                        point_reached_at = point_reached_at - :by,
                        locked_at = locked_at - :by
                    WHERE idempotency_key = :k AND scope = :s
                    """
                ),
                {"k": key, "s": self.scope, "by": by},
            )


@pytest.fixture(params=["sync", "async"])
def make(request: pytest.FixtureRequest, database_url: str) -> Iterator[Callable[..., Service]]:
    engines: list[rp.Engine | rp.AsyncEngine] = []

    def make(provider: Provider, *, hook: bool) -> Service:
        engine: rp.Engine | rp.AsyncEngine
        if request.param == "async":
            # A loop per call (asyncio.run): no connection may outlive one.
            url = normalize_url(database_url)
            engine = rp.AsyncEngine(sa_async.create_async_engine(url, poolclass=NullPool))
        else:
            engine = rp.Engine(database_url)
        engines.append(engine)
        return Service(engine, declare(provider, request.param == "async", hook))

    yield make
    for engine in engines:
        if isinstance(engine, rp.AsyncEngine):
            asyncio.run(engine.dispose())
            asyncio.run(engine.async_db.dispose())
        else:
            engine.dispose()


def complete(service: Service, min_age: float = 0) -> Any:
    """One pass of the completer on the service's engine."""
    completer = Completer(service.engine, min_age=min_age)
    try:
        return completer.run_once()
    finally:
        completer.close()


def lost_answer(service: Service, provider: Provider, key: str) -> None:
    """The first attempt charged, and its answer was lost; then the provider forgot the key."""
    charged = len(provider.charges)
    provider.fail.append("lose")
    with pytest.raises(rp.Retryable):
        service.run(key)
    assert len(provider.charges) == charged + 1


def test_a_step_inside_its_window_is_called_again_with_the_same_key(
    make: Callable[..., Service],
) -> None:
    provider = Provider()
    service = make(provider, hook=False)
    lost_answer(service, provider, "inside")
    service.later("inside", timedelta(hours=23))

    outcome = service.run("inside")

    assert outcome.body == {"charge": "ch_1"}
    assert provider.calls == [provider.calls[0]] * 2  # the provider deduped the second
    assert len(provider.charges) == 1 and provider.lookups == []


def test_past_the_window_without_a_hook_the_key_is_held_and_nothing_calls_the_step(
    make: Callable[..., Service],
) -> None:
    provider = Provider()
    service = make(provider, hook=False)
    lost_answer(service, provider, "held")
    provider.forget()
    service.later("held")

    with pytest.raises(rp.NeedsReconciliation) as held:
        service.run("held")
    assert held.value.http_status == 423
    row = service.row("held")
    assert row.reconcile_since is not None and row.lock_token is None
    assert (row.recovery_point, row.attempts) == ("ride_created", 1)  # not an attempt
    assert "keys reconcile" in row.last_error
    # A client's retry, the completer and a resume by id: none calls the step.
    with pytest.raises(rp.NeedsReconciliation):
        service.run("held")
    result = complete(service)
    assert (result.finished, result.failed, result.abandoned) == (0, 0, 0)
    with pytest.raises(rp.NeedsReconciliation):
        service.resume("held")
    assert len(provider.calls) == 1 and len(provider.charges) == 1


def test_a_hold_never_leaves_fewer_than_no_attempts(make: Callable[..., Service]) -> None:
    provider = Provider()
    service = make(provider, hook=False)
    lost_answer(service, provider, "reset")
    provider.forget()
    service.later("reset")
    # An operator's `keys retry --reset-attempts` between the claim that counts an attempt and the
    # hold that gives it back: a trigger zeroes what this scope's claim counts.
    name = f"reset_{service.scope}"
    with service.engine.db.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN NEW.attempts := 0; RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {name} BEFORE UPDATE ON idempotency_keys FOR EACH ROW "
            f"WHEN (NEW.attempts > OLD.attempts AND NEW.scope = '{service.scope}') "
            f"EXECUTE FUNCTION {name}()"
        )
    try:
        with pytest.raises(rp.NeedsReconciliation):
            service.run("reset")
    finally:
        with service.engine.db.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {name} ON idempotency_keys")
            conn.exec_driver_sql(f"DROP FUNCTION {name}()")
    row = service.row("reset")
    assert (row.reconcile_since is not None, row.attempts) == (True, 0)


def test_past_the_window_the_completer_holds_the_key_and_never_abandons_it(
    make: Callable[..., Service],
) -> None:
    provider = Provider()
    service = make(provider, hook=False)
    lost_answer(service, provider, "by-completer")
    provider.forget()
    service.later("by-completer")  # its back-off is long over too

    result = complete(service)

    assert (result.held, result.failed, result.finished) == (1, 0, 0)
    assert service.row("by-completer").reconcile_since is not None
    with service.engine.db.begin() as conn:  # out of attempts: still not abandoned
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET attempts = 3, next_attempt_at = now() WHERE scope = :s"
            ),
            {"s": service.scope},
        )
    assert complete(service).abandoned == 0
    assert service.row("by-completer").abandoned_at is None
    assert len(provider.calls) == 1


@pytest.mark.parametrize("by", ["client", "completer"])
def test_a_hook_that_finds_the_charge_records_it(make: Callable[..., Service], by: str) -> None:
    provider = Provider()
    service = make(provider, hook=True)
    lost_answer(service, provider, "found")
    first_key = provider.calls[0]
    provider.forget()
    service.later("found")

    if by == "client":
        assert service.run("found").body == {"charge": "ch_1"}
    else:
        assert complete(service).finished == 1

    assert provider.lookups == [first_key]
    assert len(provider.calls) == 1 and len(provider.charges) == 1
    assert service.run("found") == rp.Outcome(201, {"charge": "ch_1"}, {}, replayed=True)


def test_a_hook_that_finds_nothing_calls_anew_with_a_fresh_key_that_a_crash_keeps(
    make: Callable[..., Service],
) -> None:
    provider = Provider()
    service = make(provider, hook=True)
    provider.fail.append("down")  # the first call charged nothing
    with pytest.raises(rp.Retryable):
        service.run("renewed")
    first_key = provider.calls[0]
    service.later("renewed")

    provider.fail.append("down")  # the call anew fails too, after the renewal committed
    with pytest.raises(rp.Retryable):
        service.run("renewed")
    row = service.row("renewed")
    assert row.window_renewals == 1
    fresh_key = provider.calls[1]
    assert fresh_key != first_key and provider.lookups == [first_key]

    # Inside the renewed window: the same fresh key, no lookup, no renewal.
    assert service.run("renewed").body == {"charge": "ch_1"}
    assert provider.calls == [first_key, fresh_key, fresh_key]
    assert provider.charges == [("ch_1", fresh_key)]
    assert provider.lookups == [first_key]
    assert service.row("renewed").window_renewals == 1  # kept with the finished key


@pytest.mark.slow
def test_an_operator_sees_held_keys_and_reconciles_them(
    make: Callable[..., Service],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    provider = Provider()
    service = make(provider, hook=False)
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)
    app = types.ModuleType("rp_windows_app")
    app.engine = service.engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rp_windows_app", app)

    def cli(*args: str) -> tuple[int, str]:
        status = main([*args, "--app", "rp_windows_app:engine"])
        out, err = capsys.readouterr()
        return status, out + err

    def listed(*args: str) -> Any:
        """The JSON a listing prints on its standard output (logs go to its error output)."""
        assert main([*args, "--json", "--app", "rp_windows_app:engine"]) == EXIT_OK
        return json.loads(capsys.readouterr().out)

    lost_answer(service, provider, "found")
    provider.fail.append("down")
    with pytest.raises(rp.Retryable):
        service.run("not-found")
    provider.forget()
    lost_answer(service, provider, "nearing")
    for key in ("found", "not-found"):
        service.later(key)
        with pytest.raises(rp.NeedsReconciliation):
            service.run(key)
    service.later("nearing", timedelta(hours=19))  # 79 % of its window
    found, not_found = service.key_id("found"), service.key_id("not-found")

    # Seen: the listing's state, the doctor, the metric.
    held = listed("keys", "list", "--state", "needs-reconciliation")
    assert {found, not_found} <= {key["id"] for key in held}
    ops = admin.Admin.for_engine(service.engine)  # type: ignore[arg-type]
    [check] = [c for c in admin.diagnose(ops) if c.name == "dedupe windows"]
    assert check.status == "warn" and "keys reconcile" in check.hint
    assert admin.keys.nearing_windows(ops) == 1  # of this operation: "nearing" alone
    [gauge] = [
        m
        for m in DatabaseCollector(service.engine.db, service.engine.operations).collect()
        if m.name == "recoverypoint_keys_needing_reconciliation"
    ]
    assert {s.labels["operation"]: s.value for s in gauge.samples}[service.operation.name] == 2

    # `keys retry` refuses, and names what to do.
    status, out = cli("keys", "retry", str(found))
    assert status == EXIT_REFUSED and f"keys reconcile {found}" in out

    # A result PostgreSQL cannot store is refused, saying why; nothing is recorded.
    status, out = cli("keys", "reconcile", str(found), "--found", '{"charge_id": "ch_\\u0000"}')
    assert status == EXIT_USAGE and "the result found cannot be stored: it is holding a NUL" in out

    # Found: recorded as the step's result; the retry goes on without calling the step.
    status, out = cli("keys", "reconcile", str(found), "--found", '{"charge_id": "ch_1"}')
    assert status == EXIT_OK, out
    assert service.run("found").body == {"charge": "ch_1"}
    # Not found: the step is called anew, with a fresh key, by the completer's next pass,
    # though the key's last run (the one that held it) was just now: the operator decided
    # for the client, as with `keys retry`.
    status, out = cli("keys", "reconcile", str(not_found), "--not-found")
    assert status == EXIT_OK, out
    assert complete(service, min_age=3600).finished == 2  # and "nearing", inside its window

    first_found, first_not_found, nearing = provider.calls[:3]
    [fresh] = set(provider.calls[3:]) - {nearing}
    assert sorted(provider.calls[3:]) == sorted([nearing, fresh])
    assert fresh not in (first_found, first_not_found)
    assert [key for _, key in provider.charges] == [first_found, nearing, fresh]
    with service.engine.db.connect() as conn:
        audited = conn.execute(
            sa.text(
                "SELECT count(*) FROM audit_log WHERE action = 'keys.reconcile' "
                "AND ids && CAST(:ids AS bigint[])"
            ),
            {"ids": [found, not_found]},
        ).scalar_one()
    assert audited == 2


def test_windows_are_declared_sanely() -> None:
    op = rp.Operation("declared")
    for window in (timedelta(0), timedelta(seconds=-1), timedelta(days=366), 86400):
        with pytest.raises(rp.DeclarationError, match="dedupe_window"):
            op.foreign_step("charged", dedupe_window=window)  # type: ignore[arg-type]
    with pytest.raises(rp.DeclarationError, match="without a dedupe_window"):
        op.foreign_step("charged", reconcile=lambda step, params: None)
    with pytest.raises(rp.DeclarationError, match="pass a function"):
        op.foreign_step("charged", dedupe_window=WINDOW, reconcile="find")  # type: ignore[arg-type]


def test_a_reconcile_hook_of_the_other_kind_is_refused_at_registration(
    database_url: str,
) -> None:
    rides = declare(Provider(), asynchronous=False, hook=True)
    async_rides = declare(Provider(), asynchronous=True, hook=True)
    mixed = rp.Operation("mixed")
    mixed.atomic_phase("a")(async_rides.phases[0].fn)
    mixed.foreign_step("b", dedupe_window=WINDOW, reconcile=rides.phases[1].reconcile)(
        async_rides.phases[1].fn
    )
    mixed.atomic_phase("finished")(async_rides.phases[2].fn)
    engine = rp.AsyncEngine(database_url)
    with pytest.raises(rp.DeclarationError, match="reconcile hook of 'b' must be async def"):
        engine.register(mixed)
    asyncio.run(engine.dispose())
