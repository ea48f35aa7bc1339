"""Dispatch: which backend runs a request, and when.

Owns the dispatcher (``dispatcher.py``: the bounded queues per priority class, the fair order
across tenants, the grant of a backend's room, the wait estimate), the backends' capacity and
state (``capacity.py``, ``backends.py``, ``tenant_load.py``), the engines' scraped saturation
(``scrape.py``), the circuit breakers (``breaker.py``), and the two things it calls or enforces
that the stages above it provide: the ``Router`` protocol and its ``RoutingDecision``
(``router.py``, implemented by ``gateway/routing/``), and this process's part of each backend's
capacity (``quota.py``, computed by ``gateway/fleet/``). What the dispatcher tells the stages
above it (a request waits, demand changed, a decision was acted on) goes through one observer
protocol given at construction (``observers.py``), never through callbacks assigned later.
What the engines say of themselves is read here too: each answer's reused tokens
(``cache_report.py``), the engines' own limits against the declared capacity (``engine_limits.py``,
``capacity_check.py``: said, and taken under ``capacity: auto``), and their KV-event feeds (``kv_feeds.py``: run and
watched, not yet routed on).

Below routing and the fleet in the stage order (``tests/test_import_graph.py``): the routers
read the backends' state from here. It imports neither, nor the pipeline or the upstream client.
"""
