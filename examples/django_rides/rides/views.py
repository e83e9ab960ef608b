from __future__ import annotations

from django.http import HttpResponse
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.views import APIView

from .operations import idempotency, rides


class RideSerializer(serializers.Serializer):  # type: ignore[misc]
    origin = serializers.CharField(max_length=200)
    target = serializers.CharField(max_length=200)


class RideView(APIView):
    """POST /rides with an Idempotency-Key: DRF authenticates and validates, recoverypoint
    books the ride once per key, whatever crashes and retries come between."""

    @idempotency.phased()  # its key and answers in the schema (drf-spectacular)
    def post(self, request: Request) -> HttpResponse:
        ride = RideSerializer(data=request.data)
        ride.is_valid(raise_exception=True)
        return idempotency.run(rides, request, {**ride.validated_data, "user_id": request.user.pk})
