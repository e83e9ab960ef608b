"""Database URLs as users have them: libpq's list of hosts (``h1:p1,h2:p2``, with
``target_session_attrs``), the way an application follows a primary that moves, is
accepted by the engines and every command, and reaches the server that answers; the
failover suite (test_failover.py) follows a promotion through it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.pool import NullPool

import recoverypoint as rp
from recoverypoint.database import create_engine, normalize_url


@pytest.mark.parametrize(
    ("url", "hosts", "ports", "rest"),
    [
        (
            "postgresql://u:p%40w@h1:5450,h2:5451/db?target_session_attrs=read-write",
            "h1,h2",
            "5450,5451",
            {"target_session_attrs": "read-write"},
        ),
        ("postgres://h1,h2/db", "h1,h2", None, {}),
        ("postgresql://u@[::1]:5433,10.0.0.2/db?sslmode=require", "::1,10.0.0.2", "5433,", {
            "sslmode": "require"
        }),
        ("postgresql+psycopg://u@h1:1,h2:2,h3:3", "h1,h2,h3", "1,2,3", {}),
    ],
)  # fmt: skip
def test_a_list_of_hosts_is_read_the_way_libpq_reads_it(
    url: str, hosts: str, ports: str | None, rest: dict[str, str]
) -> None:
    parsed = normalize_url(url)
    assert parsed.drivername == "postgresql+psycopg" and parsed.host is None
    assert parsed.query.get("host") == hosts and parsed.query.get("port") == ports
    assert {k: v for k, v in parsed.query.items() if k not in ("host", "port")} == rest
    assert normalize_url(parsed) == parsed  # an engine's URL, read again, is the same


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h1,h2/db?host=h3",  # the hosts named twice
        "postgresql://u@h1,:5432/db",  # a port without a host
        "postgresql://u@h1,h2:port/db",
    ],
)
def test_a_list_of_hosts_that_cannot_be_read_is_refused_with_what_to_fix(url: str) -> None:
    with pytest.raises((ValueError, sa.exc.ArgumentError)):
        sa.create_engine(normalize_url(url))


_NAMES = st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True)


@given(
    hosts=st.lists(
        st.tuples(_NAMES, st.one_of(st.none(), st.integers(1, 65535))), min_size=2, max_size=5
    ),
    database=st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True),
)
def test_any_list_of_hosts_keeps_every_host_its_port_and_the_database(
    hosts: list[tuple[str, int | None]], database: str
) -> None:
    listed = ",".join(name if port is None else f"{name}:{port}" for name, port in hosts)
    parsed = normalize_url(f"postgresql://app@{listed}/{database}?target_session_attrs=any")
    dialect = sa.create_engine(parsed).dialect
    _, params = dialect.create_connect_args(parsed)
    assert params["host"] == ",".join(name for name, _ in hosts)
    ports = [port for _, port in hosts]
    assert params.get("port", ",".join("" for _ in hosts)) == ",".join(
        "" if port is None else str(port) for port in ports
    )
    assert params["dbname"] == database and params["target_session_attrs"] == "any"


def _dead_port() -> int:
    import socket

    with socket.socket() as sock:  # bound and closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def hosts_url(database_url: str) -> str:
    """The session's database behind a list of hosts whose first one is dead: libpq moves
    on to the next, as after a failover."""
    url = sa.make_url(database_url)
    return (
        f"postgresql://{url.username}@127.0.0.1:{_dead_port()},{url.host}:{url.port or 5432}"
        f"/{url.database}?target_session_attrs=read-write"
    )


def _operation(name: str, asynchronous: bool) -> rp.Operation[Any]:
    op: rp.Operation[Any] = rp.Operation(name)
    if asynchronous:

        @op.atomic_phase("done")
        async def done_async(tx: rp.AsyncAtomicContext, params: Any) -> rp.Response:
            return rp.Response(201, {"port": await tx.scalar("SELECT inet_server_port()")})

    else:

        @op.atomic_phase("done")
        def done(tx: rp.AtomicContext, params: Any) -> rp.Response:
            return rp.Response(201, {"port": tx.scalar("SELECT inet_server_port()")})

    return op


@pytest.mark.slow
def test_both_engines_run_requests_through_a_list_of_hosts(
    hosts_url: str, database_url: str, scope: str
) -> None:
    port = sa.make_url(database_url).port or 5432
    engine = rp.Engine(hosts_url)
    sync_op = _operation("hosts-sync", asynchronous=False)
    engine.register(sync_op)
    outcome = engine.run(sync_op, key="k", params={}, scope=scope)
    assert (outcome.status, outcome.body) == (201, {"port": port})
    assert engine.run(sync_op, key="k", params={}, scope=scope).replayed
    engine.dispose()

    async def run_async() -> rp.Outcome:
        async_engine = rp.AsyncEngine(hosts_url)
        async_op = _operation("hosts-async", asynchronous=True)
        async_engine.register(async_op)
        try:
            return await async_engine.run(async_op, key="k", params={}, scope=scope)
        finally:
            await async_engine.dispose()

    assert asyncio.run(run_async()).body == {"port": port}


def _cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recoverypoint", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_every_command_takes_a_list_of_hosts(
    server_url: str, empty_database_url: str, tmp_path: Any
) -> None:
    url = sa.make_url(empty_database_url)
    listed = (
        f"postgresql://{url.username}@127.0.0.1:{_dead_port()},{url.host}:{url.port or 5432}"
        f"/{url.database}?target_session_attrs=read-write"
    )
    migrated = _cli("migrate", url=listed)
    assert migrated.returncode == 0, migrated.stderr
    db = create_engine(empty_database_url, poolclass=NullPool)
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM recoverypoint_namespace")).scalar() == 1
    db.dispose()
    for command in (["keys", "list"], ["jobs", "list"], ["doctor"]):
        done = _cli(*command, url=listed)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr


_SCHEMES = st.from_regex(r"[a-zA-Z][a-zA-Z0-9+.-]{0,15}", fullmatch=True).filter(
    lambda scheme: scheme not in ("postgres", "postgresql", "postgresql+psycopg")
)


@given(
    scheme=_SCHEMES,
    password=st.text(min_size=1, max_size=20),
    other=st.text(min_size=1, max_size=20),
    rest=st.sampled_from(["@localhost/db", "@h1:3306,h2/db?ssl=1", "@[::1]/db", "@host"]),
)
def test_a_url_of_another_database_is_refused_by_its_scheme_never_its_password(
    scheme: str, password: str, other: str, rest: str
) -> None:
    messages = []
    for secret in (password, other):
        with pytest.raises(ValueError) as refused:
            normalize_url(f"{scheme}://app:{secret}{rest}")
        messages.append(str(refused.value))
    assert messages[0] == messages[1]  # nothing of the password reaches the error
    assert f"the scheme is {scheme!r}" in messages[0]
    assert "postgresql://" in messages[0]


@pytest.mark.parametrize(
    "url",
    [
        "app:s3cret@localhost/db",  # no scheme at all
        "app:s3cret@localhost://db",  # "://" past the password
        "",
    ],
)
def test_a_url_without_a_scheme_is_refused_without_echoing_it(url: str) -> None:
    with pytest.raises(ValueError, match="postgresql://") as refused:
        normalize_url(url)
    assert "s3cret" not in str(refused.value) and "app" not in str(refused.value)


def test_a_sqlalchemy_url_of_another_database_names_its_driver_not_its_password() -> None:
    with pytest.raises(ValueError) as refused:
        normalize_url(sa.make_url("mysql+pymysql://app:s3cret@localhost/db"))
    assert "the scheme is 'mysql+pymysql'" in str(refused.value)
    assert "s3cret" not in str(refused.value)


def _pids_in_turn(connect: Any) -> tuple[int, int, int]:
    """The server processes of two connections borrowed at once and given back in turn, and
    of the next one borrowed."""

    def pid(conn: Any) -> int:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())

    with connect() as first, connect() as second:
        pids = pid(first), pid(second)
        first.close()  # given back first; second goes back as the block ends
    with connect() as after:
        return (*pids, pid(after))


def test_engines_made_from_a_url_hand_out_the_connection_given_back_last(
    database_url: str,
) -> None:
    """A pool larger than the requests in flight keeps a few connections busy and the rest
    idle when it hands out the connection given back last (benchmarks/README.md, "The
    pool's order"); an application's own engine keeps the order it was made with."""
    engine = rp.Engine(database_url)
    try:
        first, second, after = _pids_in_turn(engine.db.connect)
        assert after == second != first
    finally:
        engine.dispose()
    own = sa.create_engine(normalize_url(database_url))
    try:
        first, second, after = _pids_in_turn(rp.Engine(own).db.connect)
        assert after == first != second  # SQLAlchemy's default: the longest idle first
    finally:
        own.dispose()

    async def in_turn_async() -> tuple[tuple[int, int, int], list[int]]:
        async_engine = rp.AsyncEngine(database_url)
        query = sa.text("SELECT pg_backend_pid()")
        try:
            sync_side = _pids_in_turn(async_engine.db.connect)
            async with (
                async_engine.async_db.connect() as first,
                async_engine.async_db.connect() as second,
            ):
                pids = [(await conn.execute(query)).scalar_one() for conn in (first, second)]
                await first.close()  # given back first
            async with async_engine.async_db.connect() as after:
                pids.append((await after.execute(query)).scalar_one())
            return sync_side, pids
        finally:
            await async_engine.dispose()

    sync_side, async_side = asyncio.run(in_turn_async())
    assert sync_side[2] == sync_side[1] != sync_side[0]
    assert async_side[2] == async_side[1] != async_side[0]
