"""Dispatch: which backend runs a request, and when.

Owns the dispatcher (``dispatcher.py``: the bounded queues per priority class, the fair order
across tenants, the grant of a backend's room, the wait estimate), the backends' capacity and
state (``capacity.py``, ``backends.py``, ``tenant_load.py``), the engines' scraped saturation
(``scrape.py``), and the circuit breakers (``breaker.py``).

Below routing in the stage order (``tests/test_import_graph.py``): the routers read the
backends' state from here. Its imports of routing's router protocol and of the fleet's quota are
walls still to build (``UPWARD_TODAY``); it never imports the pipeline or the upstream client.
"""
