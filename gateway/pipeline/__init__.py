"""The pipeline: one request from its context to its outcome.

Owns the handler (``handler.py``: the sequence of calls, the only catch-all of the request
path), the attempts loop of one request (``attempts.py``: it decides retries before the first
byte within the budget of ``gateway/upstream/retry.py``, fallbacks, migrations of a broken
stream), one attempt (``attempt.py``: it does, and returns a frozen result), the migration's
continuation and splice (``migration.py``), the relay of a stream (``relay.py``: it forwards),
the client's side of the response
(``client_response.py``), the frozen request context and outcome (``context.py``,
``outcome.py``), the one place that records an outcome (``recorder.py``), and the protocols
it consumes from the stages above it (``shadowing.py``: the shadow runner; the server's
disconnect signal is ``gateway/request/disconnect.py``'s).

May import every stage below it (``STAGE_ORDER`` in ``tests/test_import_graph.py``).
"""
