from django.conf import settings
from django.db import models


class Ride(models.Model):
    """A ride booked by a user; its charge is recorded once the provider made it."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    origin = models.CharField(max_length=200)
    target = models.CharField(max_length=200)
    key_id = models.BigIntegerField(unique=True)  # the idempotency key that booked it
    charge_id = models.CharField(max_length=100, null=True)


class AuditRecord(models.Model):
    """What happened, written in the same transaction as what it records."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    action = models.CharField(max_length=50)
    key_id = models.BigIntegerField()
