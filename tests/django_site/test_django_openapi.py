"""drf-spectacular's schema of the test site's DRF views: single-step methods (on an
APIView, through ``method_decorator``, a ViewSet's ``create`` and its ``@action``) and a
phased one (Rocket Rides' ``RideView``, ``@idempotency.phased()``) declare the key, the
replay header and the problem answers; views that are not idempotent declare nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from recoverypoint.integrations._openapi import KEY_PATTERN

PROBLEMS = {"400", "409", "413", "422", "423", "503"}


def schema(patterns: Any = None) -> dict[str, Any]:
    return SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)  # type: ignore[no-any-return]


def assert_declared(op: dict[str, Any], *, key: str = "Idempotency-Key") -> None:
    found = [p for p in op["parameters"] if p["in"] == "header" and p["name"] == key]
    assert len(found) == 1 and found[0]["required"] is True, op["parameters"]
    assert found[0]["schema"]["pattern"] == KEY_PATTERN
    assert set(op["responses"]) >= PROBLEMS
    for status in PROBLEMS:
        problem = op["responses"][status]["content"]["application/problem+json"]
        assert problem["schema"] == {"$ref": "#/components/schemas/IdempotencyProblem"}
    assert op["responses"]["409"]["headers"]["Retry-After"]["required"] is True
    own = [s for s in op["responses"] if s not in PROBLEMS]
    assert own and all("Idempotent-Replayed" in op["responses"][s]["headers"] for s in own)


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/drf", "post"),
        ("/method-decorator", "post"),
        ("/viewset", "post"),
        ("/viewset/refund", "post"),
        ("/rides", "post"),
    ],
)
def test_idempotent_drf_views_declare_the_key_and_the_answers(path: str, method: str) -> None:
    document = schema()
    assert_declared(document["paths"][path][method])
    problem = document["components"]["schemas"]["IdempotencyProblem"]
    assert problem["required"] == ["type", "title", "status", "detail"]


class Plain(APIView):
    def post(self, request: Any) -> Response:
        return Response({})


class Declared(APIView):
    @extend_schema(summary="With its own schema")  # composes: the declaration is added
    def post(self, request: Any) -> Response:
        return Response({})


def test_extend_schema_and_a_renamed_key_header() -> None:
    from django.urls import path

    from recoverypoint.integrations._openapi import Declaration, declared

    declared(Declared.post, Declaration("X-Request-Id", "X-Replayed", key_required=False))
    document = schema([path("declared", Declared.as_view()), path("plain", Plain.as_view())])
    op = document["paths"]["/declared"]["post"]
    assert op["summary"] == "With its own schema"
    key = next(p for p in op["parameters"] if p["name"] == "X-Request-Id")
    assert key["required"] is False
    assert {"X-Replayed", "Idempotent-Unprotected"} <= set(op["responses"]["200"]["headers"])
    plain = document["paths"]["/plain"]["post"]
    assert "parameters" not in plain and not PROBLEMS & set(plain["responses"])


def test_the_schema_shown_in_the_django_page_is_the_sites() -> None:
    from docs_snippets import blocks, page

    shown = [json.loads(b.body) for b in blocks(page("how-to/django.md")) if b.lang == "json"]
    op = schema()["paths"]["/rides"]["post"]
    answers = op["responses"]
    excerpt = {
        "parameters": [p for p in op["parameters"] if p["name"] == "Idempotency-Key"],
        "responses": {"200": {"headers": answers["200"]["headers"]}, "423": answers["423"]},
    }
    # The operation's excerpt; the page's other JSON is a problem's body.
    assert [block for block in shown if "parameters" in block] == [excerpt]
