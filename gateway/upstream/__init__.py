"""Upstream: talking to the engines.

Owns the data plane's HTTP/1.1 client (``wire.py``), the call of one attempt and the reading of
its answer (``client.py``), the body each backend gets (``body.py``: the frozen request plus that
backend's fields, salts and priority), and the mapping and sanitising of the engines' errors
(``errors.py``).

May import the policy, the dialects, the engine table and the errors; nothing of the pipeline.
"""
