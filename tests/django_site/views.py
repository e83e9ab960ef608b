"""Views of every kind Django has, made single-step; each counts its runs in ``RUNS``."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from examples.django_rides.rides.models import AuditRecord
from examples.django_rides.rides.operations import idempotency, rides

RUNS: Counter[str] = Counter()


def _answer(kind: str, request: Any) -> HttpResponse:
    RUNS[kind] += 1
    # A body no two runs share, with bytes no text encoding keeps: a replay must carry these.
    body = f"{kind} {uuid.uuid4()} ".encode() + bytes([0, 0xFF, 0xFE]) + request.body
    return HttpResponse(body, status=201, content_type="application/octet-stream")


@idempotency.single_step("django_function_view")
def function_view(request: HttpRequest) -> HttpResponse:
    return _answer("function", request)


@idempotency.single_step("django_async_view")
async def async_view(request: HttpRequest) -> HttpResponse:
    return _answer("async", request)


@idempotency.single_step("django_not_found")
def not_found(request: HttpRequest) -> HttpResponse:
    RUNS["not_found"] += 1
    raise Http404("no such order")


class ClassView(View):
    @idempotency.single_step("django_class_view")
    def post(self, request: HttpRequest) -> HttpResponse:
        return _answer("class", request)


class DRFView(APIView):
    @idempotency.single_step("django_drf_view")
    def post(self, request: Request) -> Response:
        RUNS["drf"] += 1
        return Response({"order": str(uuid.uuid4()), "got": request.data}, status=201)


@method_decorator(idempotency.single_step("django_drf_method_decorator"), name="post")
class MethodDecoratedView(APIView):
    def post(self, request: Request) -> Response:
        RUNS["method_decorator"] += 1
        return Response({"order": str(uuid.uuid4()), "got": request.data}, status=201)


@idempotency.single_step("django_cookie_view")
def cookie_view(request: HttpRequest) -> HttpResponse:
    response = _answer("cookie", request)
    response.set_cookie("cart", "emptied")
    response["X-Order-Cost"] = "3"
    return response


class OrderViewSet(viewsets.ViewSet):
    @idempotency.single_step("django_drf_viewset")
    def create(self, request: Request) -> Response:
        RUNS["viewset"] += 1
        return Response({"order": str(uuid.uuid4())}, status=201)

    @action(detail=False, methods=["post"])
    @idempotency.single_step("django_drf_action")
    def refund(self, request: Request) -> Response:
        RUNS["action"] += 1
        return Response({"refund": str(uuid.uuid4())}, status=201)


def runs(request: HttpRequest) -> JsonResponse:
    return JsonResponse(dict(RUNS))


# Held open by the test of a key in flight: ENTERED once the view runs, until RELEASE.
ENTERED, RELEASE = threading.Event(), threading.Event()


@idempotency.single_step("django_held_view")
def held_view(request: HttpRequest) -> HttpResponse:
    ENTERED.set()
    RELEASE.wait(timeout=60)
    return _answer("held", request)


@idempotency.single_step("django_async_orm_view")
async def async_orm_view(request: HttpRequest) -> HttpResponse:
    user = await request.auser()
    record = await AuditRecord.objects.acreate(user=user, action="async.view", key_id=0)
    RUNS["async_orm"] += 1
    return JsonResponse({"record": record.pk}, status=201)


async def async_ride(request: HttpRequest) -> HttpResponse:
    user = await request.auser()
    params = {**json.loads(request.body), "user_id": user.pk}
    return await idempotency.arun(rides, request, params)
