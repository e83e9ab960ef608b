"""The HTTP contract without a server: reading the key, errors as problem+json, replays."""

from __future__ import annotations

import json

import pytest

import recoverypoint as rp
from recoverypoint.integrations._problem import outcome_reply, problem_reply, read_key


@pytest.mark.parametrize(
    ("values", "key"),
    [
        (["8e03978e-40d5"], "8e03978e-40d5"),
        ([" 8e03978e-40d5 "], "8e03978e-40d5"),
        (['"8e03978e-40d5"'], "8e03978e-40d5"),
        (['"a\\"b\\\\c"'], 'a"b\\c'),
        (['"a,b"'], "a,b"),
    ],
)
def test_keys_are_read_bare_or_as_sf_strings(values: list[str], key: str) -> None:
    assert read_key(values) == key


@pytest.mark.parametrize(
    "values",
    [[], [""], ['""'], ["a", "b"], ["a,b"], ['"a'], ['"a"b"'], ["k" * 256], ["tab\there"]],
)
def test_missing_repeated_or_invalid_keys_are_refused(values: list[str]) -> None:
    with pytest.raises(rp.InvalidKey):
        read_key(values)


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (rp.InvalidKey(), 400, None),
        (rp.InvalidParams("the item is missing"), 422, None),
        (rp.ParamsMismatch(), 422, None),
        (rp.RequestTooLarge(), 413, None),
        (rp.KeyInUse(retry_after=80), 409, "2"),
        (rp.KeyInUse(retry_after=1), 409, "1"),
        (rp.LockLost(), 409, "2"),
        (rp.ConcurrentUpdate(), 409, "2"),
        (rp.Retryable("db at 10.0.0.1 down"), 503, "2"),
        (rp.OperationNotRegistered("op x at /srv/app"), 500, None),
        (KeyError("/srv/app/secret"), 500, None),
    ],
)
def test_errors_become_problems_with_the_drafts_statuses(
    error: Exception, status: int, retry_after: str | None
) -> None:
    reply = problem_reply(error, retry_after=2)
    headers = dict(reply.headers)
    body = json.loads(reply.body)

    assert reply.status == body["status"] == status
    assert headers["Content-Type"] == "application/problem+json"
    assert headers.get("Retry-After") == retry_after
    assert body["type"].startswith("tag:recoverypoint,2025:") and body["title"]
    if status >= 500:  # never the message: phase code may have put internals there
        assert "10.0.0.1" not in reply.body.decode() and "/srv/app" not in reply.body.decode()
    else:
        assert body["detail"] == " ".join(str(error).split())


def test_a_500_tells_the_client_to_retry_with_the_same_key() -> None:
    body = json.loads(problem_reply(RuntimeError("boom"), retry_after=1).body)
    assert "same Idempotency-Key" in body["detail"]


def test_replays_are_marked_and_bodies_follow_their_status_and_type() -> None:
    replay = outcome_reply(rp.Outcome(201, {"id": 1}, {"X-Id": "1"}, replayed=True))
    assert dict(replay.headers) == {
        "X-Id": "1",
        "Idempotent-Replayed": "true",
        "Content-Type": "application/json",
    }
    assert json.loads(replay.body) == {"id": 1}

    empty = outcome_reply(rp.Outcome(204, None, {"Content-Type": "x/y"}, replayed=False))
    assert (empty.body, empty.headers) == (b"", [])

    text = outcome_reply(rp.Outcome(200, "hi", {"Content-Type": "text/plain"}, replayed=False))
    assert text.body == b"hi"
