"""The console in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``;
``.ci/run`` installs them): an operator opens the overview, filters the keys, opens a
stuck key, retries it and sees it finish once the completer has run; abandons keys in
bulk after their confirmation; a viewer is refused an action; the standalone command
asks for its token. Each page is saved as a PNG in ``.ci-artifacts/console/``.

Without the browser the tests are skipped, unless RECOVERYPOINT_REQUIRE_SERVICES=1: then
they fail, as a missing service should.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import MOUNT, Provider, app_for, module_fixtures
from http_servers import serve_asgi
from workload import plant_keys, rows, stage_jobs

import recoverypoint as rp
from recoverypoint.workers import Completer

pytestmark = [
    pytest.mark.slow,  # Chromium
    pytest.mark.xdist_group("console_browser"),  # started once for the module
]

db, provider, engine = module_fixtures()

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / ".ci-artifacts" / "console"
STUCK = {
    "next_attempt_at": "now() - interval '40 minutes'",
    "attempts": "3",
    "last_error": "'RuntimeError: payments API down'",
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        message = (
            f"no headless browser: {', '.join(missing)} missing "
            "(apt-get install chromium chromium-driver)"
        )
        if os.environ.get("RECOVERYPOINT_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; RECOVERYPOINT_REQUIRE_SERVICES=1 requires it")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # the system's: nothing is downloaded
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def site(engine: rp.Engine, db: sa.Engine) -> Iterator[str]:
    """The console mounted in a FastAPI app, served on loopback: its base URL."""
    with serve_asgi(app_for(engine)) as url:
        yield url + MOUNT


def as_role(browser: Any, site: str, role: str) -> None:
    browser.get(site + "/static/console.css")  # a page of the site, to set its cookie on
    browser.delete_all_cookies()
    browser.add_cookie({"name": "role", "value": role, "path": "/"})


def shot(browser: Any, name: str) -> None:
    """The whole page, however long, as a PNG."""
    size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1400, "height": int(size["height"]), "deviceScaleFactor": 1, "mobile": False},
    )
    try:
        png = browser.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})["data"]
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    (ARTIFACTS / f"{name}.png").write_bytes(base64.b64decode(png))


def by_id(browser: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.ID, element_id)


def follow(browser: Any, element: Any) -> None:
    """Click ``element`` and wait until the page it leads to has loaded."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.wait import WebDriverWait

    # Asked of the document, not of an element of the old page: while a page is replaced,
    # Chromium's driver can answer for an old element with an "unknown error" (its node no
    # longer belongs to the document) instead of calling it stale.
    browser.execute_script("window.recoverypointOldPage = true")
    element.click()
    WebDriverWait(browser, 15, ignored_exceptions=(WebDriverException,)).until(
        lambda b: b.execute_script(
            "return !window.recoverypointOldPage && document.readyState === 'complete'"
        )
    )


def stuck_key(engine: rp.Engine, provider: Provider, db: sa.Engine, key: str) -> int:
    """A ride whose charge failed while the provider was down, its client long gone."""
    provider.down = True
    with pytest.raises(RuntimeError):
        engine.run(
            engine.operation("charges", 1),
            key=key,
            scope="rider-7@example.com",
            params={"origin": "Pier 39", "target": "SFO"},
            request=rp.Request("POST", "/rides"),
        )
    provider.down = False
    [key_id] = [
        r.id for r in rows(db, "SELECT id FROM idempotency_keys WHERE idempotency_key = :k", k=key)
    ]
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET next_attempt_at = now() - interval "
                "'25 minutes', created_at = now() - interval '31 minutes' "
                "WHERE id = :i"
            ),
            {"i": key_id},
        )
    return key_id


def history(db: sa.Engine) -> None:
    """A day of traffic for the overview's chart, and some keys in every state."""
    plant_keys(
        db,
        "charges",
        400,
        point="finished",
        response_status="201",
        created_at="now() - (n % 24) * interval '1 hour' - interval '5 minutes'",
        finished_at="now() - (n % 24) * interval '1 hour'",
    )
    plant_keys(
        db,
        "charges",
        9,
        point="charged",
        response_status="500",
        created_at="now() - (n * 2) * interval '1 hour' - interval '1 hour'",
        finished_at="now() - (n * 2) * interval '1 hour'",
        abandoned_at="now() - (n * 2) * interval '1 hour'",
    )
    plant_keys(db, "refunds", 3, point="reserved", next_attempt_at="now() + interval '2 minutes'")
    plant_keys(
        db, "refunds", 2, point="reserved", locked_at="now()", lock_token="gen_random_uuid()"
    )
    stage_jobs(db, 3)
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO worker_passes (worker, host, pid, last_pass_at) VALUES "
                "('completer', 'worker-1', 4242, now() - interval '3 seconds'), "
                "('enqueuer', 'worker-1', 4243, now() - interval '1 second'), "
                "('reaper', 'worker-2', 977, now() - interval '40 seconds')"
            )
        )


def test_an_operator_finds_a_stuck_key_retries_it_and_sees_it_finish(
    browser: Any, site: str, engine: rp.Engine, provider: Provider, db: sa.Engine
) -> None:
    history(db)
    key_id = stuck_key(engine, provider, db, "ride-0001")
    as_role(browser, site, "operator")

    browser.get(site + "/")
    assert by_id(browser, "stuck").text.startswith("1")
    assert "completer" in by_id(browser, "workers").text
    shot(browser, "overview")

    browser.get(site + "/keys")
    by_id(browser, "filters").find_element("name", "operation").send_keys("charges")
    browser.find_element("css selector", "input[name=state][value=stuck]").click()
    follow(browser, by_id(browser, "apply"))
    assert "state=stuck" in browser.current_url
    [link] = browser.find_elements("css selector", "table.keys tbody a")
    shot(browser, "keys")
    follow(browser, link)

    assert by_id(browser, "state").text == "stuck"
    assert "payments API down" in by_id(browser, "last-error").text
    assert "current" in by_id(browser, "phases").find_element(
        "css selector", "li.current"
    ).get_attribute("class")
    assert "rider-7@example.com" not in browser.page_source  # masked
    shot(browser, "key-stuck")

    follow(browser, by_id(browser, "action-retry"))
    assert "What changes" in browser.page_source
    shot(browser, "confirm-retry")
    follow(browser, by_id(browser, "do"))
    assert "/audit/" in browser.current_url and by_id(browser, "changed").text == "1"
    shot(browser, "audit-entry")

    Completer(engine, min_age=0).run_once()
    browser.get(f"{site}/keys/{key_id}")
    assert by_id(browser, "state").text == "finished" and by_id(browser, "status").text == "201"
    shot(browser, "key-finished")


def test_a_bulk_abandon_shows_its_confirmation_then_abandons_exactly_those(
    browser: Any, site: str, db: sa.Engine
) -> None:
    planted = plant_keys(db, "refunds", 6, point="reserved", **STUCK)
    as_role(browser, site, "operator")
    browser.get(site + "/keys?operation=refunds&state=stuck")
    follow(browser, by_id(browser, "bulk-abandon"))
    assert by_id(browser, "eligible").text == "6"
    message = browser.find_element("name", "message")
    message.clear()
    message.send_keys("The refund provider closed these accounts.")
    shot(browser, "confirm-bulk-abandon")
    follow(browser, by_id(browser, "do"))
    assert by_id(browser, "changed").text == "6"
    abandoned = rows(
        db,
        "SELECT id, response_body FROM idempotency_keys WHERE "
        "abandoned_at IS NOT NULL AND id = ANY(:ids)",
        ids=planted,
    )
    assert sorted(r.id for r in abandoned) == planted
    assert abandoned[0].response_body["message"] == "The refund provider closed these accounts."
    browser.get(site + "/audit")
    assert "keys.abandon" in browser.page_source
    shot(browser, "audit")
    browser.get(site + "/jobs")
    shot(browser, "jobs")


def test_a_viewer_sees_no_action_and_is_refused_one(browser: Any, site: str, db: sa.Engine) -> None:
    [key_id] = plant_keys(db, "charges", 1, point="reserved", **STUCK)
    as_role(browser, site, "viewer")
    browser.get(f"{site}/keys/{key_id}")
    assert by_id(browser, "state").text == "stuck"
    assert not browser.find_elements("id", "actions")
    browser.get(f"{site}/keys/{key_id}/retry")
    assert "Not allowed" in browser.page_source
    shot(browser, "viewer-refused")
    [row] = rows(
        db,
        "SELECT attempts, next_attempt_at < now() - interval '30 minutes' AS overdue "
        "FROM idempotency_keys WHERE id = :i",
        i=key_id,
    )
    assert row.overdue and row.attempts == 3


def test_the_standalone_console_asks_for_its_token(
    browser: Any, db: sa.Engine, module_database_url: str
) -> None:
    command = [
        sys.executable,
        "-m",
        "recoverypoint",
        "console",
        "--bind",
        "127.0.0.1:0",
        "--database-url",
        module_database_url,
    ]
    env = {k: v for k, v in os.environ.items() if k != "RECOVERYPOINT_CONSOLE_TOKEN"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        url = re.search(r"http://\S+", process.stdout.readline()).group(0)  # type: ignore[union-attr]
        token = process.stdout.readline().removeprefix("token: ").strip()
        browser.delete_all_cookies()
        browser.get(url)
        assert browser.find_elements("id", "token") and "Overview" not in browser.title
        by_id(browser, "token").send_keys("not-the-token-at-all")
        follow(browser, by_id(browser, "open"))
        assert "not the console" in by_id(browser, "problem").text
        shot(browser, "login")
        by_id(browser, "token").clear()
        by_id(browser, "token").send_keys(token)
        follow(browser, by_id(browser, "open"))
        assert browser.title.startswith("Overview"), browser.page_source[-800:]
        assert "token holder" in browser.page_source
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
