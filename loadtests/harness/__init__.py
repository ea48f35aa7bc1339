"""The harness: what the proofs and the tests start and observe, never a claim of its own.

Real processes started, awaited and stopped (``processes.py``), the shared Redis and its tidy-up
(``shared_redis.py``), a Redis of a bench's own (``private_redis.py``), a proxy that slows or
cuts Redis (``delay_proxy.py``), the least a Python proxy can do (``minimal_proxy.py``, the
overhead baseline) and an OTLP receiver (``otlp_sink.py``).
The harness may import the commands (``loadtests/sim/``, ``loadtests/loadgen/``,
``loadtests/whatif/``: ``processes.py`` re-exports ``whatif/processes.py``'s helpers), never a
proof (``loadtests/proofs/``); a command never imports the harness. No module of the bench
imports the tests (``tests/``): what a proof and a test both need lives here.
"""
