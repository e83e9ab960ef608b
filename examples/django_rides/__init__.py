"""Rocket Rides the Django way: a DRF view books a ride with an idempotency key; the ride is
created with the ORM, the card charged at a provider, the charge recorded, each atomic phase
committing with its recovery point. Run from the repository root, on a database of its own::

    export RECOVERYPOINT_DATABASE_URL=postgresql://postgres@127.0.0.1/rides
    python -m examples.django_rides.manage migrate
    python -m examples.django_rides.manage recoverypoint migrate
    python -m examples.django_rides.manage runserver
    python -m examples.django_rides.manage recoverypoint worker completer \\
        --app examples.django_rides.rides.operations:engine

tests/django_site runs it, a crash between the charge and its record included.
"""
