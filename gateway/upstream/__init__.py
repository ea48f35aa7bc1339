"""Upstream: talking to the engines.

Owns the data plane's HTTP/1.1 client (``wire.py``), the call of one attempt and the reading of
its answer (``client.py``), the framing of an engine's event stream (``sse_reader.py``, shared by
the relay and the shadow runner), the body each backend gets (``body.py``: the frozen request plus that
backend's fields, salts and priority), the mapping and sanitising of the engines' errors
(``errors.py``), and how often an engine may be asked again (``retry.py``: the retry budget,
backoff, ``Retry-After``), which the runtime holds and the attempts spend.

May import the policy, the dialects, the engine table and the errors; nothing of the pipeline.
"""
