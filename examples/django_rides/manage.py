#!/usr/bin/env python
"""Rocket Rides the Django way; run from the repository root:

    python -m examples.django_rides.manage migrate
    python -m examples.django_rides.manage recoverypoint migrate
    python -m examples.django_rides.manage recoverypoint worker \
        --app examples.django_rides.rides.operations:engine
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_rides.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
