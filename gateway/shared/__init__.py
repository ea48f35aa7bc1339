"""Shared state: what the gateway's processes keep together, and the one place it is opened.

The stage owns the connection to the store the policy names (``state``: ``memory`` or
``redis``), the errors a call to it may end in, and its close. The features that keep state
fleet-wide (the fleet's ledger and prefix view in ``gateway/fleet/``, response affinity, the
rollouts' store) take the handle this stage opened instead of opening their own; the tenant
limit store (``gateway/limitstore/``) keeps its own client, since it alone speaks Redis Cluster.

It may import ``gateway/policy/`` and ``gateway/shared/connect.py`` (how a URL becomes a
client); nothing of the request path.
"""
