"""The web console's rules, over HTTP against a real database: it cannot be built without
an authorizer, which decides every page and every action; every form that changes a key
needs its CSRF token and the console's own origin; scopes and params stay masked unless
the authorizer allows revealing them and the visitor asks; every action lands in the
audit table with who, what, when and which rows; and no page leaks SQL or a traceback.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import (
    LEAKS,
    MOUNT,
    Provider,
    app_for,
    client,
    csrf_token,
    module_fixtures,
)
from workload import plant_keys, rows, stage_jobs

import recoverypoint as rp
from recoverypoint import admin
from recoverypoint.cli import main as cli
from recoverypoint.console import console
from recoverypoint.database import create_engine
from recoverypoint.workers import Completer

db, provider, engine = module_fixtures()

STUCK = {"next_attempt_at": "now() - interval '1 hour'", "last_error": "'RuntimeError: down'"}
FINISHED = {"response_status": "201", "finished_at": "now() - interval '1 hour'"}
ABANDONED = {**FINISHED, "response_status": "500", "abandoned_at": "now() - interval '1 hour'"}


@pytest.fixture(scope="module")
def app(engine: rp.Engine) -> Any:
    return app_for(engine)


def plant(db: sa.Engine, operation: str, count: int = 1, **columns: Any) -> list[int]:
    point = columns.pop("point", "finished" if "finished_at" in columns else "reserved")
    return plant_keys(db, operation, count, point=point, **columns)


def key_row(db: sa.Engine, key_id: int) -> Any:
    [row] = rows(db, "SELECT * FROM idempotency_keys WHERE id = :id", id=key_id)
    return row


def audit_rows(db: sa.Engine) -> list[Any]:
    return rows(db, "SELECT * FROM audit_log ORDER BY id")


def confirm_and_post(app: Any, role: str, path: str, **form: str) -> Any:
    """Open an action's confirmation as ``role``, then send its form as a browser would."""
    with client(app, role) as browser:
        page = browser.get(MOUNT + path)
        assert page.status_code == 200, page.text
        return browser.post(MOUNT + path, data={"csrf": csrf_token(page.text), **form})


# -- authorization ---------------------------------------------------------------------------


def test_there_is_no_console_without_an_authorizer(engine: rp.Engine) -> None:
    with pytest.raises(TypeError):
        console(engine)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="needs a callable"):
        console(engine, authorize=None)  # type: ignore[arg-type]


def test_a_visitor_the_authorizer_refuses_sees_nothing(app: Any, db: sa.Engine) -> None:
    [key_id] = plant(db, "secret-op", **STUCK)
    key = key_row(db, key_id).idempotency_key
    with client(app) as nobody:
        for path in [
            "/",
            "/keys",
            f"/keys/{key_id}",
            "/jobs",
            "/audit",
            f"/keys/{key_id}/retry",
            "/keys/bulk/retry?state=stuck",
        ]:
            page = nobody.get(MOUNT + path)
            assert page.status_code == 403, path
            assert "secret-op" not in page.text and key not in page.text


@pytest.mark.slow
def test_a_viewer_sees_keys_but_no_action_and_is_refused_one(app: Any, db: sa.Engine) -> None:
    [key_id] = plant(db, "viewed", **STUCK)
    before = key_row(db, key_id)
    audited = len(audit_rows(db))
    with client(app, "viewer") as viewer:
        page = viewer.get(f"{MOUNT}/keys/{key_id}")
        assert page.status_code == 200 and "stuck" in page.text
        assert 'id="actions"' not in page.text and "/retry" not in page.text
        assert viewer.get(f"{MOUNT}/keys/{key_id}/retry").status_code == 403
        token = viewer.cookies["rp_console_csrf"]  # a valid token does not make an operator
        for action in ("retry", "release", "abandon", "reopen"):
            refused = viewer.post(f"{MOUNT}/keys/{key_id}/{action}", data={"csrf": token})
            assert refused.status_code == 403 and "Not allowed" in refused.text
        bulk = viewer.post(
            f"{MOUNT}/keys/bulk/abandon",
            data={"csrf": token, "operation": "viewed", "ids": str(key_id)},
        )
        assert bulk.status_code == 403
    assert key_row(db, key_id) == before and len(audit_rows(db)) == audited


def test_the_authorizer_is_asked_per_action_and_may_be_async(
    engine: rp.Engine, db: sa.Engine
) -> None:
    asked: list[str] = []

    async def only_retry(request: Any, action: str) -> str | None:
        asked.append(action)
        return "ann" if action in ("view", "keys.retry") else None

    app = app_for(engine, authorize=only_retry)
    [key_id] = plant(db, "async-authorized", **STUCK)
    with client(app) as visitor:
        page = visitor.get(f"{MOUNT}/keys/{key_id}")
        assert 'id="action-retry"' in page.text and 'id="action-abandon"' not in page.text
        assert visitor.get(f"{MOUNT}/keys/{key_id}/abandon").status_code == 403
    assert {"view", "reveal", "keys.retry", "keys.abandon"} <= set(asked)
    done = confirm_and_post(app, "", f"/keys/{key_id}/retry")
    assert done.status_code == 303
    assert audit_rows(db)[-1].actor == "ann"


def test_an_authorizer_that_answers_nonsense_fails_closed(engine: rp.Engine) -> None:
    app = app_for(engine, authorize=lambda request, action: True)
    with client(app) as visitor:
        page = visitor.get(f"{MOUNT}/keys")
    assert page.status_code == 500 and not LEAKS.search(page.text)


# -- CSRF ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token, headers",
    [
        (None, {}),  # no token
        ("x" * 43, {}),  # a token, not this browser's
        ("same", {"origin": "https://evil.example"}),  # this browser's token, another site
        ("same", {"origin": "", "referer": ""}),  # no origin at all
    ],
    ids=["missing", "wrong", "cross-origin", "no-origin"],
)
def test_an_action_without_its_csrf_token_or_from_elsewhere_is_refused(
    app: Any, db: sa.Engine, token: str | None, headers: dict[str, str]
) -> None:
    [key_id] = plant(db, "forged", **STUCK)
    before, audited = key_row(db, key_id), len(audit_rows(db))
    with client(app, "operator") as browser:
        page = browser.get(f"{MOUNT}/keys/{key_id}/abandon")
        form = (
            {} if token is None else {"csrf": csrf_token(page.text) if token == "same" else token}
        )
        for name, value in headers.items():
            browser.headers[name] = value
        if not browser.headers.get("origin"):
            del browser.headers["origin"]
        refused = browser.post(f"{MOUNT}/keys/{key_id}/abandon", data=form)
    assert refused.status_code == 403 and "Refused" in refused.text
    assert key_row(db, key_id) == before and len(audit_rows(db)) == audited


FORGERIES = pytest.mark.parametrize(
    "token, headers",
    [
        (None, {}),
        ("x" * 43, {}),
        ("same", {"origin": "https://evil.example"}),
        ("same", {"origin": "", "referer": ""}),
    ],
    ids=["missing", "wrong", "cross-origin", "no-origin"],
)


@FORGERIES
def test_a_bulk_action_without_its_csrf_token_or_from_elsewhere_is_refused(
    app: Any, db: sa.Engine, token: str | None, headers: dict[str, str]
) -> None:
    """The bulk form is checked as the single key's is: a forged one changes no key."""
    stuck = plant(db, "forged_bulk", 2, **STUCK)
    before, audited = [key_row(db, i) for i in stuck], len(audit_rows(db))
    with client(app, "operator") as browser:
        confirm = browser.get(f"{MOUNT}/keys/bulk/abandon?operation=forged_bulk&state=stuck")
        assert confirm.status_code == 200, confirm.text
        form: dict[str, Any] = {
            "ids": ",".join(map(str, stuck)),
            "operation": "forged_bulk",
            "state": "stuck",
        }
        if token is not None:
            form["csrf"] = csrf_token(confirm.text) if token == "same" else token
        for name, value in headers.items():
            browser.headers[name] = value
        if not browser.headers.get("origin"):
            del browser.headers["origin"]
        refused = browser.post(f"{MOUNT}/keys/bulk/abandon", data=form)
    assert refused.status_code == 403 and "Refused" in refused.text
    assert [key_row(db, i) for i in stuck] == before and len(audit_rows(db)) == audited


def test_the_csrf_cookie_is_http_only_strict_and_for_the_console_alone(app: Any) -> None:
    with client(app, "operator") as browser:
        cookie = browser.get(f"{MOUNT}/keys").headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and f"Path={MOUNT}" in cookie


# -- masking ---------------------------------------------------------------------------------


def test_scopes_and_params_are_masked_unless_revealing_is_allowed_and_asked(
    app: Any, db: sa.Engine
) -> None:
    [key_id] = plant(db, "masked", params={"card": "4242424242424242"}, **STUCK)
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET scope = 'alice@example.com', "
                'state = \'{"ride": "ride-of-alice"}\' WHERE id = :i'
            ),
            {"i": key_id},
        )
    secrets = ("alice@example.com", "4242424242424242", "ride-of-alice")

    def shown(browser: Any) -> str:
        return (
            browser.get(f"{MOUNT}/keys/{key_id}").text
            + browser.get(f"{MOUNT}/keys?operation=masked").text
        )

    with client(app, "viewer") as viewer:
        text = shown(viewer)
        assert not any(s in text for s in secrets)
        assert admin.Admin(db).mask("alice@example.com") in text
        asked = viewer.post(
            f"{MOUNT}/reveal", data={"csrf": viewer.cookies["rp_console_csrf"], "show": "1"}
        )
        assert asked.status_code == 403
        viewer.cookies.set("rp_console_reveal", "1")  # the cookie alone reveals nothing
        assert not any(s in shown(viewer) for s in secrets)
        assert viewer.get(f"{MOUNT}/keys?scope=alice%40example.com").status_code == 400
    with client(app, "revealer") as revealer:
        assert not any(s in shown(revealer) for s in secrets)  # allowed, not asked yet
        page = revealer.get(f"{MOUNT}/keys")
        asked = revealer.post(
            f"{MOUNT}/reveal", data={"csrf": csrf_token(page.text), "show": "1", "next": "/keys"}
        )
        assert asked.status_code == 303 and asked.headers["location"] == f"{MOUNT}/keys"
        assert all(s in shown(revealer) for s in secrets)
        found = revealer.get(f"{MOUNT}/keys?scope=alice%40example.com")
        assert f'/keys/{key_id}"' in found.text


def test_an_actions_pages_mask_what_the_key_page_masks(app: Any, db: sa.Engine) -> None:
    """An operator who has not asked to reveal (or may not) sees an action's confirmation
    masked, as the key's own page, and cannot select keys by a guessed scope in bulk."""
    [key_id] = plant(db, "masked_action", params={"card": "4111111111111111"}, **STUCK)
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET scope = 'bob@example.com' WHERE id = :i"),
            {"i": key_id},
        )
    secrets = ("bob@example.com", "4111111111111111")
    with client(app, "operator") as operator:
        for action in ("retry", "release", "abandon", "reopen"):
            page = operator.get(f"{MOUNT}/keys/{key_id}/{action}")
            assert page.status_code in (200, 409), page.text
            assert not any(s in page.text for s in secrets), action
        guessed = "operation=masked_action&scope=bob%40example.com"
        assert operator.get(f"{MOUNT}/keys/bulk/abandon?{guessed}").status_code == 400
        confirm = operator.get(f"{MOUNT}/keys/bulk/abandon?operation=masked_action")
        sent = operator.post(
            f"{MOUNT}/keys/bulk/abandon",
            data={"csrf": csrf_token(confirm.text), "ids": str(key_id),
                  "operation": "masked_action", "scope": "bob@example.com"},
        )  # fmt: skip
        assert sent.status_code == 400
    assert key_row(db, key_id).finished_at is None


def test_reveal_goes_back_to_a_console_page_never_elsewhere(app: Any) -> None:
    with client(app, "revealer") as revealer:
        page = revealer.get(f"{MOUNT}/keys")
        for target in ("https://evil.example/", "//evil.example/x", "/\\evil.example"):
            back = revealer.post(
                f"{MOUNT}/reveal", data={"csrf": csrf_token(page.text), "show": "0", "next": target}
            )
            assert back.headers["location"] == f"{MOUNT}/"


# -- actions and the audit table -------------------------------------------------------------


def test_a_retry_is_confirmed_then_fenced_applied_and_audited(
    app: Any, db: sa.Engine, engine: rp.Engine, provider: Provider
) -> None:
    provider.down = True
    with pytest.raises(RuntimeError, match="payments API down"):
        engine.run(
            engine.operation("charges", 1),
            key="ride-1",
            scope="bob",
            params={},
            request=rp.Request("POST", "/rides"),
        )
    provider.down = False
    [key_id] = [
        r.id for r in rows(db, "SELECT id FROM idempotency_keys WHERE idempotency_key = 'ride-1'")
    ]
    with db.begin() as conn:  # an hour later: stuck
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET next_attempt_at = now() - interval '1 hour' "
                "WHERE id = :i"
            ),
            {"i": key_id},
        )
    with client(app, "operator") as browser:
        page = browser.get(f"{MOUNT}/keys/{key_id}")
        assert re.search(r'class="current"[^>]*>\s*<div class="p">→ reserved', page.text)
        assert "payments API down" in page.text
        # The charge's downstream key, in full: what the provider was (and will be) given.
        assert re.search(
            r'id="downstream">\s*<dt>charged</dt><dd class="mono">rp_[0-9a-f]{64}<', page.text
        )
        confirm = browser.get(f"{MOUNT}/keys/{key_id}/retry")
        assert "What changes" in confirm.text and key_row(db, key_id).attempts == 1
        done = browser.post(f"{MOUNT}/keys/{key_id}/retry", data={"csrf": csrf_token(confirm.text)})
        assert done.status_code == 303 and done.headers["location"].startswith(f"{MOUNT}/audit/")
        entry = browser.get(done.headers["location"])
        assert "operator-user (console) changed" in entry.text
    [record] = [r for r in audit_rows(db) if r.ids == [key_id]]
    assert (record.actor, record.via, record.action, record.matched) == (
        "operator-user",
        "console",
        "keys.retry",
        1,
    )
    assert record.details == {"reset": False}
    Completer(engine, min_age=0).run_once()
    with client(app, "viewer") as viewer:
        assert 'id="state">finished' in viewer.get(f"{MOUNT}/keys/{key_id}").text


def test_a_bulk_abandon_acts_only_on_the_keys_it_confirmed_that_still_qualify(
    app: Any, db: sa.Engine
) -> None:
    stuck = plant(db, "bulk", 4, **STUCK)
    plant(db, "bulk", 2, **FINISHED)
    with client(app, "operator") as browser:
        confirm = browser.get(
            f"{MOUNT}/keys/bulk/abandon?operation=bulk&state=stuck&state=finished"
        )
        assert re.search(r'id="eligible">4<', confirm.text), confirm.text
        listed = re.search(r'name="ids" value="([^"]+)"', confirm.text).group(1)  # type: ignore[union-attr]
        assert sorted(map(int, listed.split(","))) == stuck
        # Meanwhile one finishes, and one more gets stuck: neither is touched.
        with db.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET finished_at = now(), "
                    "response_status = 201 WHERE id = :i"
                ),
                {"i": stuck[0]},
            )
        [late] = plant(db, "bulk", **STUCK)
        done = browser.post(
            f"{MOUNT}/keys/bulk/abandon",
            data={
                "csrf": csrf_token(confirm.text),
                "ids": listed,
                "operation": "bulk",
                "state": ["stuck", "finished"],
                "response_status": "503",
                "message": "provider gone",
            },
        )
        assert done.status_code == 303, done.text
    abandoned = [
        r.id
        for r in rows(
            db,
            "SELECT id FROM idempotency_keys WHERE operation = 'bulk' "
            "AND abandoned_at IS NOT NULL ORDER BY id",
        )
    ]
    assert abandoned == stuck[1:] and late not in abandoned
    assert key_row(db, stuck[1]).response_status == 503
    record = audit_rows(db)[-1]
    assert (record.action, record.ids, record.matched, record.actor) == (
        "keys.abandon",
        stuck[1:],
        4,
        "operator-user",
    )
    assert record.details == {"force": False, "status": 503}


def test_a_bulk_action_needs_a_filter(app: Any) -> None:
    with client(app, "operator") as browser:
        assert browser.get(f"{MOUNT}/keys/bulk/retry").status_code == 400


def test_a_refused_single_action_says_why_and_changes_nothing(app: Any, db: sa.Engine) -> None:
    [key_id] = plant(db, "refused", **FINISHED)
    with client(app, "operator") as browser:
        page = browser.get(f"{MOUNT}/keys/{key_id}/retry")
        assert page.status_code == 409 and "nothing to retry" in page.text
        assert 'id="do"' not in page.text
        posted = browser.post(f"{MOUNT}/keys/{key_id}/retry", data={"csrf": csrf_token(page.text)})
        assert posted.status_code == 409


def test_the_cli_records_its_actions_in_the_same_audit_table(
    db: sa.Engine, module_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    [key_id] = plant(db, "from-cli", **STUCK)
    assert cli(["keys", "retry", str(key_id), "--database-url", module_database_url]) == 0
    record = audit_rows(db)[-1]
    assert (record.via, record.action, record.ids) == ("cli", "keys.retry", [key_id])
    assert "@" in record.actor  # user@host


def test_the_audit_pages_list_every_action_newest_first(app: Any, db: sa.Engine) -> None:
    [key_id] = plant(db, "audited", **STUCK)  # an action of its own: tests run in any order
    assert confirm_and_post(app, "operator", f"/keys/{key_id}/retry").status_code == 303
    with client(app, "viewer") as viewer:
        page = viewer.get(f"{MOUNT}/audit")
    newest = audit_rows(db)[-1]
    assert page.status_code == 200 and f'href="{MOUNT}/audit/{newest.id}"' in page.text


# -- pages -----------------------------------------------------------------------------------


def test_every_page_answers_with_its_content_and_no_leak(app: Any, db: sa.Engine) -> None:
    [stuck] = plant(db, "pages", **STUCK)
    [abandoned] = plant(db, "pages", **ABANDONED)
    stage_jobs(db, 2)
    with client(app, "operator") as browser:
        overview = browser.get(f"{MOUNT}/")
        assert 'id="stuck"' in overview.text and "<svg" in overview.text
        assert "never" in overview.text  # no worker ever ran a pass here
        assert re.search(r"pages@1</td>\s*<td><span class=\"badge stuck\"", overview.text)
        keys = browser.get(f"{MOUNT}/keys?operation=pages")
        assert f'/keys/{stuck}"' in keys.text and f'/keys/{abandoned}"' in keys.text
        searched = browser.get(f"{MOUNT}/keys?q={stuck}")
        assert f'/keys/{stuck}"' in searched.text and f'/keys/{abandoned}"' not in searched.text
        jobs = browser.get(f"{MOUNT}/jobs")
        assert "notify" in jobs.text or "job" in jobs.text
        for page in (overview, keys, searched, jobs):
            assert page.status_code == 200 and not LEAKS.search(page.text)
            assert page.headers["x-frame-options"] == "DENY"
            assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
            assert page.headers["cache-control"] == "no-store"
        assert browser.get(f"{MOUNT}/keys/{2**63}").status_code == 404
        assert browser.get(f"{MOUNT}/keys/0").status_code == 404
        assert browser.get(f"{MOUNT}/no-such-page").status_code == 404


def test_listings_page_by_keyset_without_gaps_or_repeats(app: Any, db: sa.Engine) -> None:
    planted = plant(db, "paged", 60, **STUCK)
    seen: list[int] = []
    url: str | None = f"{MOUNT}/keys?operation=paged&limit=25"
    with client(app, "viewer") as viewer:
        while url:
            page = viewer.get(url)
            seen += [int(i) for i in re.findall(rf'href="{MOUNT}/keys/(\d+)"', page.text)]
            older = re.search(r'id="older" href="([^"]+)"', page.text)
            url = older.group(1).replace("&amp;", "&") if older else None
    assert seen == sorted(planted, reverse=True)


def test_a_database_that_does_not_answer_gets_a_page_without_sql() -> None:
    unreachable = admin.Admin(create_engine("postgresql://127.0.0.1:1/x"))
    app = app_for(unreachable)
    with client(app, "operator") as browser:
        for path in ("/", "/keys", "/keys/1", "/jobs", "/audit"):
            page = browser.get(MOUNT + path)
            assert page.status_code == 503 and "did not answer" in page.text
            assert not LEAKS.search(page.text) and "127.0.0.1" not in page.text


# -- the standalone command and the package --------------------------------------------------


@pytest.mark.parametrize(
    "options, refusal",
    [
        (["--bind", "0.0.0.0:0"], "not a loopback address"),
        (["--bind", "0.0.0.0:0", "--allow-remote", "--no-token"], "loopback address only"),
        (["--bind", "nowhere"], "HOST:PORT"),
        (["--token", "short"], "16 characters"),
    ],
)
def test_the_standalone_console_stays_on_loopback_behind_a_token_unless_told(
    module_database_url: str, options: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["console", "--database-url", module_database_url, *options]) == 2
    assert refusal in capsys.readouterr().err


@pytest.mark.slow
def test_the_wheel_ships_the_templates_and_the_stylesheet(tmp_path: Any) -> None:
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(root)],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("recoverypoint-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        p.relative_to(root / "src").as_posix()
        for p in (root / "src/recoverypoint/console").rglob("*")
        if p.suffix in (".html", ".css")
    }
    assert shipped and shipped <= names


def test_the_docs_mount_works_word_for_word(
    db: sa.Engine, module_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from docs_snippets import section

    [mount] = [b for b in section("how-to/operating.md", "Web console") if b.lang == "python"]
    assert mount.mark_value == "tests/test_console.py"
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", module_database_url)
    scope: dict[str, Any] = {}
    exec(compile(mount.body, mount.where, "exec"), scope)
    [key_id] = plant(db, "from-readme", **STUCK)
    app = scope["app"]
    try:
        with client(app) as anonymous:
            assert anonymous.get(f"{MOUNT}/keys/{key_id}").status_code == 403
        with client(app) as bob:
            bob.headers["x-forwarded-email"] = "bob@example.com"
            page = bob.get(f"{MOUNT}/keys/{key_id}")
            assert page.status_code == 200 and 'id="actions"' not in page.text
        with client(app) as alice:
            alice.headers["x-forwarded-email"] = "alice@example.com"
            confirm = alice.get(f"{MOUNT}/keys/{key_id}/retry")
            done = alice.post(
                f"{MOUNT}/keys/{key_id}/retry", data={"csrf": csrf_token(confirm.text)}
            )
            assert done.status_code == 303
        assert audit_rows(db)[-1].actor == "alice@example.com"
    finally:
        scope["engine"].dispose()
