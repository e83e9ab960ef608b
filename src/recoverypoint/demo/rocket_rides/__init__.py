"""Rocket Rides: the reference service of Stripe-like idempotency keys, rebuilt on recoverypoint.

Three processes, each started with ``python -m recoverypoint.demo.rocket_rides COMMAND`` from the
repository root:

- ``provider``: a fake payment provider over HTTP (:mod:`.provider`), with fault knobs;
- ``api``: ``POST /rides``, an operation of three phases that charges through it (:mod:`.api`);
- ``simulate``: clients that book rides with the retrying client (:mod:`.simulate`).

``migrate`` creates recoverypoint's tables and the example's (:mod:`.schema`).
"""
