"""Dispatch: which backend runs a request, and when.

Owns the dispatcher (``dispatcher.py``: the bounded queues per priority class, the fair order
across tenants, the grant of a backend's room, the wait estimate), the backends' capacity and
state (``capacity.py``, ``backends.py``, ``tenant_load.py``), the engines' scraped saturation
(``scrape.py``), and the circuit breakers (``breaker.py``).

May import routing (the model's router picks among the backends with room), the fleet's view
of capacity, the policy and the telemetry; never the pipeline or the upstream client.
"""
