"""A replay repeats the answer, never a credential: headers that carry a session or a
credential (standard or an API's own), and those of one connection, are neither stored nor
replayed; every other header of the answer is, exactly."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import recoverypoint as rp
from recoverypoint.keys import safe_headers

CREDENTIALS = {
    "Authorization": "Bearer eyJhbGciOi.secret",
    "Cookie": "session=secret",
    "Set-Cookie": "session=secret",
    "Proxy-Authorization": "Basic c2VjcmV0",
    "Authentication-Info": "nextnonce=secret",
    "X-Auth-Token": "secret",
    "X-Api-Key": "secret",
    "X-Amz-Security-Token": "secret",
    "X-CSRF-Token": "secret",
    "X-Session-Id": "secret",
}
# The headers of one connection or one message: a replay has its own.
ONE_MESSAGE = {
    "Connection": "keep-alive",
    "Keep-Alive": "timeout=5",
    "Transfer-Encoding": "chunked",
    "Content-Length": "999",
    "TE": "trailers",
    "Trailer": "Expires",
    "Upgrade": "websocket",
    "Proxy-Authenticate": "Basic",
}
ANSWER = {"Location": "/prefs/1", "ETag": '"v1"', "X-Request-Cost": "3", "Retry-After": "5"}


def test_an_answer_is_replayed_without_the_credentials_it_carried(
    engine: rp.Engine, db: sa.Engine, scope: str
) -> None:
    op: rp.Operation[Any] = rp.Operation("log_in")

    @op.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(200, {"ok": True}, {**ANSWER, **CREDENTIALS, **ONE_MESSAGE})

    engine.register(op)
    first = engine.run(op, key="k", params={}, scope=scope)
    replay = engine.run(op, key="k", params={}, scope=scope)

    assert first.headers == ANSWER
    assert replay.headers == ANSWER and replay.replayed
    with db.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT response_headers::text FROM idempotency_keys WHERE scope = :s"),
            {"s": scope},
        ).scalar_one()
    assert not any(value in stored for value in CREDENTIALS.values())


CREDENTIAL_WORDS = ["auth", "cookie", "token", "session", "secret", "password", "api-key",
                    "apikey", "csrf", "xsrf", "credential", "signature"]  # fmt: skip
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "te", "trailer",
              "transfer-encoding", "upgrade", "content-length"}  # fmt: skip
NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-"), max_size=12)


@settings(database=None, max_examples=300)
@given(before=NAME, word=st.sampled_from(CREDENTIAL_WORDS), after=NAME, upper=st.booleans())
def test_no_header_whose_name_names_a_credential_is_kept(
    before: str, word: str, after: str, upper: bool
) -> None:
    name = f"{before}{word}{after}"
    name = name.upper() if upper else name.title()
    assert safe_headers({name: "secret", "Location": "/x"}) == {"Location": "/x"}


@settings(database=None, max_examples=300)
@given(name=NAME.filter(lambda n: n), value=st.text(max_size=20))
def test_every_other_header_is_kept_exactly(name: str, value: str) -> None:
    assume(not any(w in name for w in CREDENTIAL_WORDS) and name not in HOP_BY_HOP)
    assert safe_headers({name: value}) == {name: value}
