"""Shared state: what the gateway's processes keep together, and the one place it is opened.

The stage owns the connection to the store the policy names (``state``: ``memory`` or
``redis``: ``store.py``), the one way a call to it is bounded (in the event loop's free time:
``lag.py``), the errors a call may end in, Redis's health as the calls find it, and the close.
Every feature that keeps state fleet-wide (the tenant limit store in ``gateway/limitstore/``, the
fleet's ledger and prefix view in ``gateway/fleet/``, response affinity, the rollouts' store) uses
the client this stage opened instead of opening its own; ``tests/shared/test_store.py`` fails if
a module outside this stage opens one.

It may import ``gateway/policy/``; nothing of the request path.
"""
