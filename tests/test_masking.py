"""Masked means nothing to brute-force: a viewer who may not reveal sees, for a scope, a
param, a phase output, a stored response or the request's fingerprint, only a digest keyed
with the installation's own secret. No unkeyed digest (which would confirm a guessed
amount, PIN or scope in seconds), no first characters, no length; the same value masks
the same way within one installation, and differently in another."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from console_site import MOUNT, Provider, app_for, client, console_database, engine_for
from hypothesis import given, settings
from hypothesis import strategies as st

from recoverypoint import admin
from recoverypoint.cli import main
from recoverypoint.exits import EXIT_OK
from recoverypoint.keys import canonical_json, fingerprint

SCOPE = "alice@example.com"
PARAMS = {"amount": 1234, "pin": "0420", "note": "bought a boat"}
MASKED = re.compile(r"…#[0-9a-f]{10}")


@pytest.fixture(scope="module")
def db(module_database_url: str) -> Iterator[sa.Engine]:
    with console_database(module_database_url) as engine:
        yield engine


@pytest.fixture(scope="module")
def key_id(db: sa.Engine) -> int:
    """A key run by the engine as a client would: its scope, params and fingerprint real."""
    engine = engine_for(db, Provider())
    outcome = engine.run(engine.operation("charges", 1), key="k-1", params=PARAMS, scope=SCOPE)
    assert outcome.status == 201
    with db.connect() as conn:
        return int(conn.execute(sa.text("SELECT id FROM idempotency_keys")).scalar_one())


def confirmations(values: list[str]) -> list[str]:
    """What would confirm a guess at each value: its unkeyed digests (whole, or the 6-hex
    prefix masks once showed), the request's unkeyed fingerprint, its first characters."""
    found = []
    for value in values:
        digest = hashlib.sha256(value.encode()).hexdigest()
        found += [digest, digest[:6], f"{value[:2]}…"]
    found.append(fingerprint("POST", "/test", canonical_json(PARAMS)))
    return found


SECRETS = [SCOPE, "1234", "0420", "bought a boat"]


def shown(values: list[str], page: str) -> list[str]:
    """Those of ``values`` the page shows as values of their own, not inside a longer word:
    a downstream key cut to ``rp_…c04…`` does not show ``04…``, nor a digest ``…a1234…``
    the amount."""
    return [v for v in values if re.search(rf"(?<!\w){re.escape(v)}", page)]


def test_a_viewer_gets_nothing_a_guess_can_be_checked_against(db: sa.Engine, key_id: int) -> None:
    with client(app_for(admin.Admin(db)), "viewer") as viewer:
        page = viewer.get(f"{MOUNT}/keys/{key_id}").text + viewer.get(f"{MOUNT}/keys").text
    assert not shown(SECRETS, page)
    # The fingerprint the engine stored, which a page once showed whole.
    with db.connect() as conn:
        stored = conn.execute(sa.text("SELECT fingerprint FROM idempotency_keys")).scalar_one()
    assert not shown([*confirmations(SECRETS), stored], page)
    ops = admin.Admin(db)
    assert ops.mask(SCOPE) in page and ops.mask(stored) in page and ops.mask("0420") in page


@pytest.mark.slow
def test_the_cli_masks_what_the_console_masks_unless_revealed(
    db: sa.Engine, key_id: int, module_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--database-url", module_database_url]
    assert main(["keys", "show", str(key_id), *url]) == EXIT_OK
    masked = capsys.readouterr().out
    with db.connect() as conn:
        stored, charge = conn.execute(
            sa.text("SELECT fingerprint, state->>'charge' FROM idempotency_keys")
        ).one()
    # The fingerprint, and the phase output and response (a charge's id) too.
    assert not shown([*SECRETS, stored, charge], masked)
    assert main(["keys", "show", str(key_id), "--reveal", *url]) == EXIT_OK
    revealed = capsys.readouterr().out
    assert all(s in revealed for s in [*SECRETS, stored, charge])


@pytest.mark.slow
def test_each_installation_masks_with_its_own_secret(db: sa.Engine, worker_db: sa.Engine) -> None:
    here, there = admin.Admin(db).mask, admin.Admin(worker_db).mask
    assert here(SCOPE) == admin.Admin(db).mask(SCOPE)  # stable across processes
    assert here(SCOPE) != there(SCOPE)
    assert here(SCOPE) != "…#" + hashlib.sha256(SCOPE.encode()).hexdigest()[:10]


@pytest.mark.slow
def test_a_database_without_its_secret_is_told_to_migrate(worker_db: sa.Engine) -> None:
    with worker_db.begin() as conn:
        conn.execute(sa.text("DELETE FROM installation_secrets"))
    with pytest.raises(LookupError, match="recoverypoint migrate"):
        admin.Mask.of(worker_db)


@settings(database=None, max_examples=300)
@given(value=st.text(), other=st.text())
@pytest.mark.slow
def test_a_masked_value_is_a_keyed_digest_and_nothing_else(value: str, other: str) -> None:
    mask = admin.Mask(b"s" * 32)
    shown = mask(value)
    assert shown == "" if value == "" else MASKED.fullmatch(shown)
    assert (mask(value) == mask(other)) == (value == other) or not value or not other
    assert mask(value) != admin.Mask(b"t" * 32)(value) or not value


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(database=None, max_examples=200)
@given(value=JSON)
@pytest.mark.slow
def test_masked_json_keeps_the_shape_and_masks_every_leaf(value: Any) -> None:
    mask = admin.Mask(b"s" * 32)

    def check(original: Any, masked: Any) -> None:
        if isinstance(original, dict):
            assert list(masked) == list(original)
            for name in original:
                check(original[name], masked[name])
        elif isinstance(original, list):
            assert len(masked) == len(original)
            for a, b in zip(original, masked, strict=True):
                check(a, b)
        elif original is None or isinstance(original, bool) or str(original) == "":
            assert masked == original
        else:
            assert MASKED.fullmatch(masked), masked

    check(value, mask.json(value))
