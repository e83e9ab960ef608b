"""The standalone console answers only its own names: a page whose name an attacker points at
127.0.0.1 (DNS rebinding) is refused before it sees a page or a token, and no POST it sends
changes a key, whatever ``Origin`` it claims. Whatever ``Host``, ``Origin``, ``Referer``,
cookie and form token a request carries, a key changes only when all of them are the
console's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import sqlalchemy as sa
from console_site import console_database
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from workload import plant_keys, rows

from recoverypoint import admin
from recoverypoint.cli import main
from recoverypoint.cli._app import UsageError
from recoverypoint.cli.console import standalone, trusted_hosts
from recoverypoint.exits import EXIT_USAGE

HOSTILE = settings(
    database=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STUCK = {"next_attempt_at": "now() - interval '1 hour'"}


@pytest.fixture(scope="module")
def db(module_database_url: str) -> Iterator[sa.Engine]:
    with console_database(module_database_url) as engine:
        yield engine


def unfinished(db: sa.Engine, key_id: int) -> bool:
    [row] = rows(db, "SELECT finished_at FROM idempotency_keys WHERE id = :i", i=key_id)
    return row.finished_at is None


@pytest.fixture(scope="module")
def served(module_database_url: str, db: sa.Engine) -> Iterator[str]:
    """``recoverypoint console --no-token`` on loopback, as a laptop runs it: its URL."""
    command = [sys.executable, "-m", "recoverypoint", "console", "--no-token", "--bind",
               "127.0.0.1:0", "--database-url", module_database_url]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RECOVERYPOINT_CONSOLE_TOKEN"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        found = re.search(r"http://\S+/", process.stdout.readline())
        assert found, "the console printed no address"
        yield found.group(0).rstrip("/")
    finally:
        process.terminate()
        process.wait(30)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.slow
def test_a_rebound_name_gets_neither_a_page_nor_a_token_nor_an_action(
    served: str, db: sa.Engine
) -> None:
    [key_id] = plant_keys(db, "charges", 1, point="reserved", **STUCK)
    port = served.rsplit(":", 1)[1]
    evil = f"rebind.attacker.example:{port}"
    with httpx.Client(base_url=served, headers={"host": evil}) as attacker:
        page = attacker.get(f"/keys/{key_id}/abandon")
        assert page.status_code == 400 and "csrf" not in page.text
        token = "t" * 43
        sent = attacker.post(
            f"/keys/{key_id}/abandon",
            data={"csrf": token},
            headers={"origin": f"http://{evil}", "cookie": f"rp_console_csrf={token}"},
        )
        assert sent.status_code == 400
    assert unfinished(db, key_id)
    # Its own names still answer: the address it printed, and localhost.
    for own in (f"127.0.0.1:{port}", f"localhost:{port}"):
        with httpx.Client(base_url=served, headers={"host": own}) as browser:
            assert browser.get(f"/keys/{key_id}/abandon").status_code == 200


def test_its_names_are_its_address_localhost_on_loopback_and_those_given() -> None:
    assert trusted_hosts("127.0.0.1", []) == ["127.0.0.1", "localhost"]
    assert trusted_hosts("::1", ["Ops.Example.com"]) == ["[::1]", "localhost", "ops.example.com"]
    assert trusted_hosts("10.0.0.5", []) == ["10.0.0.5"]
    assert trusted_hosts("0.0.0.0", ["ops.example.com"]) == ["0.0.0.0", "ops.example.com"]
    # Bound to every address, its names cannot be guessed: refused here, before a server
    # starts (the command's test below would serve, and wait, if they were not).
    with pytest.raises(UsageError, match="--allowed-host"):
        trusted_hosts("::", [])
    for name in ("*.example.com", "*", "ops.example.com:8080", "ops example", ""):
        with pytest.raises(UsageError, match="no port"):
            trusted_hosts("127.0.0.1", [name])


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (["--bind", "0.0.0.0:0", "--allow-remote"], "--allowed-host"),
        (["--bind", "[::]:0", "--allow-remote"], "--allowed-host"),
        (["--allowed-host", "*.example.com"], "no port"),
        (["--allowed-host", "ops.example.com:8080"], "no port"),
    ],
)
def test_a_console_that_cannot_know_its_names_is_not_started(
    module_database_url: str, options: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["console", "--database-url", module_database_url, *options]) == EXIT_USAGE
    assert refusal in capsys.readouterr().err


# -- hostile Host, Origin, Referer and tokens -------------------------------------------------

OWN = "127.0.0.1:8080"
# What an HTTP client can put in a header: bytes, read as latin-1.
LATIN_1 = st.characters(codec="latin-1", exclude_characters="\r\n")
TOKEN = "k" * 43
HOSTS = st.one_of(
    st.sampled_from([OWN, "localhost:8080", "LOCALHOST", "127.0.0.1", "[::1]:8080",
                     "rebind.attacker.example:8080", "127.0.0.1.attacker.example", "localhost.",
                     "127.0.0.1:8080@evil", "", " ", "127.0.0.1 :8080", "[::ffff:127.0.0.1]",
                     "2130706433", "0x7f.1", "127.1", "localhost\x00.evil"]),
    st.text(LATIN_1, max_size=30),
)  # fmt: skip
ORIGINS = st.one_of(
    st.none(),
    st.sampled_from([f"http://{OWN}", "http://localhost:8080", "null", "http://evil.example",
                     f"https://{OWN}", f"http://{OWN}/keys", ""]),
    HOSTS.map(lambda host: f"http://{host}"),
)  # fmt: skip
TOKENS = st.one_of(
    st.just(TOKEN), st.sampled_from(["", "k" * 31, "k" * 65, "é" * 40]), st.text(LATIN_1)
)


@pytest.fixture(scope="module")
def app(db: sa.Engine) -> Any:
    ops = admin.Admin(db, via="console")
    return standalone(ops, token=None, read_only=False, hosts=trusted_hosts("127.0.0.1", []))


def sent_from(source: str | None) -> str | None:
    """The host and port a URL names (the scheme aside: behind a TLS proxy the console is
    served over http to a page the browser loaded over https); None if it is no URL."""
    try:
        return urlsplit(source).netloc if source else None
    except ValueError:
        return None


def own_host(host: str) -> bool:
    return re.fullmatch(r"(127\.0\.0\.1|localhost)(:\d+)?", host, re.IGNORECASE) is not None


@pytest.mark.slow
@HOSTILE
@given(host=HOSTS)
@example(host="rebind.attacker.example:8080")
@example(host="localhost:8080")
@example(host="127.0.0.1:8080@evil")  # a port that is not one: Starlette 0.40 took 127.0.0.1
def test_only_its_own_names_get_a_page(app: Any, host: str) -> None:
    with TestClient(app, base_url=f"http://{OWN}", follow_redirects=False) as browser:
        page = browser.get("/keys", headers={"host": host.encode("latin-1")})
    assert page.status_code == (200 if own_host(host) else 400), (host, page.text[:200])


@pytest.mark.slow
@HOSTILE
@given(
    host=HOSTS,
    origin=ORIGINS,
    referer=ORIGINS,
    cookie=TOKENS,
    submitted=TOKENS,
)
@example(host=OWN, origin=f"http://{OWN}", referer=None, cookie=TOKEN, submitted=TOKEN)
@example(host=OWN, origin=None, referer="http://[", cookie=TOKEN, submitted=TOKEN)
@example(host=OWN, origin=None, referer=f"https://{OWN}", cookie=TOKEN, submitted=TOKEN)
@example(host=OWN, origin="", referer=f"http://evil@{OWN}/", cookie=TOKEN, submitted=TOKEN)
@example(host="evil.example:8080", origin="http://evil.example:8080", referer=None,
         cookie=TOKEN, submitted=TOKEN)  # fmt: skip
@example(host="LOCALHOST", origin=None, referer="http://LOCALHOST", cookie=TOKEN,
         submitted=TOKEN)  # fmt: skip
def test_a_key_changes_only_when_host_origin_and_token_are_all_its_own(
    app: Any, db: sa.Engine, host: str, origin: str | None, referer: str | None,
    cookie: str, submitted: str,
) -> None:  # fmt: skip
    [key_id] = plant_keys(db, "charges", 1, point="reserved", **STUCK)
    sent_headers = {"host": host, "cookie": f"rp_console_csrf={cookie}"}
    for name, value in (("origin", origin), ("referer", referer)):
        if value is not None:
            sent_headers[name] = value
    headers = {name: value.encode("latin-1") for name, value in sent_headers.items()}
    with TestClient(app, base_url=f"http://{OWN}", follow_redirects=False) as browser:
        form = {"csrf": submitted}
        sent = browser.post(f"/keys/{key_id}/abandon", data=form, headers=headers)
    assert sent.status_code in (303, 400, 403), sent.text[:300]
    source = sent_from(origin or referer)
    same_origin = source is not None and source.lower() == host.lower()  # names: any case
    legitimate = own_host(host) and same_origin and cookie == TOKEN
    legitimate = legitimate and submitted == TOKEN
    assert unfinished(db, key_id) != legitimate, (sent.status_code, sent.text[:300])


# -- the token's login page ------------------------------------------------------------------


@pytest.fixture(scope="module")
def locked(db: sa.Engine) -> Any:
    ops = admin.Admin(db, via="console")
    return standalone(ops, token=TOKEN, read_only=False, hosts=trusted_hosts("127.0.0.1", []))


def test_the_login_page_is_styled_before_the_token_is_given(locked: Any) -> None:
    with TestClient(locked, base_url=f"http://{OWN}", follow_redirects=False) as stranger:
        login = stranger.get("/keys")
        assert login.status_code == 401 and 'name="token"' in login.text
        [href] = re.findall(r'<link rel="stylesheet" href="([^"]+)"', login.text)
        css = stranger.get(href)
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert ".login" in css.text  # the rules the login form is drawn with
        assert stranger.head(href).status_code == 200


@pytest.mark.slow
@HOSTILE
@given(
    path=st.one_of(
        st.sampled_from(["/static/console.css/", "/static/console.css/../keys", "/static/",
                         "/static/../keys", "/static//console.css", "/static/console.css%00",
                         "/STATIC/console.css", "/static/console.css;/keys", "/keys", "/"]),
        st.text(LATIN_1, max_size=30).map(lambda tail: "/static/" + tail),
    ),
    method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE"]),
)  # fmt: skip
def test_nothing_else_passes_without_the_token(locked: Any, path: str, method: str) -> None:
    with TestClient(locked, base_url=f"http://{OWN}", follow_redirects=False) as stranger:
        try:
            answer = stranger.request(method, path)
        except Exception:  # a path no client can send is no request
            return
    if answer.status_code != 401:
        assert method in ("GET", "HEAD") and answer.request.url.path == "/static/console.css"
        assert answer.status_code == 200
    else:
        assert method == "HEAD" or 'name="token"' in answer.text


def log_in(browser: Any, token: str) -> Any:
    return browser.post("/login", data={"token": token}, headers={"origin": f"http://{OWN}"})


def test_only_the_token_opens_the_console(locked: Any) -> None:
    with TestClient(locked, base_url=f"http://{OWN}", follow_redirects=False) as stranger:
        for wrong in ("", "k" * 42, "k" * 44, TOKEN.upper(), "x" * 43):
            refused = log_in(stranger, wrong)
            assert refused.status_code == 401 and "That is not the console" in refused.text
            assert "rp_console_token" not in refused.headers.get("set-cookie", "")
            assert stranger.get("/keys").status_code == 401
        opened = log_in(stranger, TOKEN)
        assert opened.status_code == 303 and "rp_console_token" in opened.headers["set-cookie"]
        assert stranger.get("/keys").status_code == 200


def test_a_read_only_console_shows_keys_and_changes_none(db: sa.Engine) -> None:
    ops = admin.Admin(db, via="console")
    app = standalone(ops, token=TOKEN, read_only=True, hosts=trusted_hosts("127.0.0.1", []))
    [key_id] = plant_keys(db, "charges", 1, point="reserved", **STUCK)
    with TestClient(app, base_url=f"http://{OWN}", follow_redirects=False) as holder:
        assert log_in(holder, TOKEN).status_code == 303
        assert holder.get(f"/keys/{key_id}").status_code == 200
        for action in ("retry", "release", "abandon", "reopen"):
            assert holder.get(f"/keys/{key_id}/{action}").status_code == 403
            sent = holder.post(
                f"/keys/{key_id}/{action}",
                data={"csrf": holder.cookies["rp_console_csrf"]},
                headers={"origin": f"http://{OWN}"},
            )
            assert sent.status_code == 403, sent.text[:300]
    assert unfinished(db, key_id)


@HOSTILE
@given(host=HOSTS)
@example(host="ops.example.com:443@evil")  # Starlette 0.40's TrustedHostMiddleware took it
@example(host="OPS.example.com:8443")
@pytest.mark.slow
def test_a_console_mounted_behind_own_hosts_answers_only_its_names(
    db: sa.Engine, host: str
) -> None:
    """What the operating page tells a team that mounts the console in its own app."""
    from starlette.applications import Starlette

    from recoverypoint.console import OwnHosts, console

    app = Starlette()
    ops = admin.Admin(db, via="console")
    app.mount("/ops", console(ops, authorize=lambda request, action: "ops@test"))
    app.add_middleware(OwnHosts, hosts=["ops.example.com"])
    named = re.fullmatch(r"ops\.example\.com(:\d+)?", host, re.IGNORECASE) is not None
    with TestClient(app, base_url="http://ops.example.com", follow_redirects=False) as browser:
        page = browser.get("/ops/keys", headers={"host": host.encode("latin-1")})
    assert page.status_code == (200 if named else 400), (host, page.text[:200])
