"""Telemetry: what the gateway measures and exports.

Owns every metric name, label and bucket (``metrics.py``, ``labels.py``; their exposition, which
samples the dispatcher's live gauges, is the server's: ``gateway/server/exposition.py``), goodput
and its windows (``goodput.py``, ``window.py``), cost (``cost.py``, ``cost_meter.py``), traces
and their export (``tracing.py``, ``otlp.py``), and the request trace log (``tracelog.py``; the
prompt signatures it writes, keyed hashes of the prefix chain and never text, are routing's:
``gateway/routing/prefix_signature.py``).

Low in the stage order, imported by nearly every stage; its few imports of higher stages (goodput
and cost take the pipeline's outcome, traces name the dialect, the trace log the signature's type)
are listed in ``UPWARD_TODAY`` (``tests/test_import_graph.py``).
"""
