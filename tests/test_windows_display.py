"""What an operator sees of a provider's dedupe window, in `recoverypoint keys show` and
on the console's key page: the downstream key a step is called with now (a fresh one
after a `--not-found` renewal), a key held for reconciliation and what to do about it,
when the window of an unfinished key's next step closes, and nothing of a window for a
finished key. The keys are made by the engine on real PostgreSQL (test_dedupe_windows'
operation and provider), "25 hours later" by moving their moments back."""

from __future__ import annotations

import html
import json
import re
import sys
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from console_site import MOUNT, app_for, client
from test_dedupe_windows import Provider, Service, complete, declare, lost_answer

import recoverypoint as rp
from recoverypoint.cli import main
from recoverypoint.exits import EXIT_OK


@pytest.fixture
def service(database_url: str) -> Iterator[Callable[..., Service]]:
    engines: list[rp.Engine] = []

    def make(provider: Provider, *, hook: bool) -> Service:
        engine = rp.Engine(database_url)
        engines.append(engine)
        return Service(engine, declare(provider, False, hook))

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def show(
    monkeypatch: pytest.MonkeyPatch, database_url: str, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Any]:
    """`keys show ID --app` of the service's engine: its fields, and its JSON."""
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", database_url)

    def show(service: Service, key: str) -> tuple[dict[str, str], Any]:
        app = types.ModuleType("rp_display_app")
        app.engine = service.engine  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "rp_display_app", app)
        key_id = str(service.key_id(key))
        capsys.readouterr()  # what came before: not this key's
        assert main(["keys", "show", key_id, "--app", "rp_display_app:engine"]) == EXIT_OK
        text = capsys.readouterr().out
        assert main(["keys", "show", key_id, "--json", "--app", "rp_display_app:engine"]) == 0
        detail = json.loads(capsys.readouterr().out)
        fields = dict(
            re.split(r"\s{2,}", line, maxsplit=1)
            for line in text.split("\n\n")[0].splitlines()
            if "  " in line
        )
        steps = {p["point"]: p["downstream_key"] for p in detail["phases"]}
        return fields, {**detail, "steps": steps}

    return show


def key_page(service: Service, key: str) -> str:
    with client(app_for(service.engine), "viewer") as browser:
        page = browser.get(f"{MOUNT}/keys/{service.key_id(key)}")
    assert page.status_code == 200, page.text
    return html.unescape(page.text)


def test_after_a_not_found_renewal_keys_show_has_the_fresh_downstream_key(
    service: Callable[..., Service], show: Callable[..., Any]
) -> None:
    provider = Provider()
    held = service(provider, hook=False)
    provider.fail.append("down")  # the first call charged nothing
    with pytest.raises(rp.Retryable):
        held.run("renewed")
    first = provider.calls[0]
    _, before = show(held, "renewed")
    assert before["steps"]["charge_created"] == first

    held.later("renewed")
    with pytest.raises(rp.NeedsReconciliation):
        held.run("renewed")
    fields, detail = show(held, "renewed")
    key_id = held.key_id("renewed")
    assert fields["state"] == "needs-reconciliation"
    assert fields["dedupe window"].startswith("needs reconciliation since ")
    reconcile = f"`recoverypoint keys reconcile {key_id} --found JSON` or `--not-found`"
    assert reconcile in fields["dedupe window"]
    assert "foreign step 'charge_created' is past" in detail["window"]
    page = key_page(held, "renewed")
    assert 'class="badge needs-reconciliation"' in page
    assert f"keys reconcile {key_id} --found JSON" in page

    not_found = ["keys", "reconcile", str(key_id), "--not-found", "--app", "rp_display_app:engine"]
    assert main(not_found) == EXIT_OK
    assert complete(held).finished == 1
    fresh = provider.calls[1]
    assert fresh != first and provider.charges == [("ch_1", fresh)]
    fields, detail = show(held, "renewed")
    # Finished with its renewal kept: the key it was called with, no window open.
    assert detail["steps"]["charge_created"] == fresh
    assert "dedupe window" not in fields and detail["window"] is None
    assert 'id="window"' not in key_page(held, "renewed")


@pytest.mark.slow
def test_an_unfinished_key_says_when_its_steps_window_closes_and_what_comes_after(
    service: Callable[..., Service], show: Callable[..., Any]
) -> None:
    provider = Provider()
    hooked = service(provider, hook=True)
    lost_answer(hooked, provider, "waiting")
    hooked.later("waiting", timedelta(hours=20))
    row = hooked.row("waiting")

    fields, detail = show(hooked, "waiting")

    closes = row.point_reached_at + timedelta(hours=24)
    said = f"the window of step 'charge_created' closes at {closes:%Y-%m-%d %H:%M:%S}"
    assert fields["dedupe window"] == said and detail["window"] == said
    assert detail["steps"]["charge_created"] == provider.calls[0]
    assert f'<dd id="window">{said}</dd>' in key_page(hooked, "waiting")

    hooked.later("waiting", timedelta(hours=5))  # 25 hours: closed, not yet resumed
    fields, _ = show(hooked, "waiting")
    assert fields["dedupe window"].endswith(
        ": the next attempt asks its reconcile hook what the last call did"
    )
    assert hooked.run("waiting").body == {"charge": "ch_1"}  # the hook found the charge
    fields, detail = show(hooked, "waiting")
    assert "dedupe window" not in fields and detail["window"] is None
