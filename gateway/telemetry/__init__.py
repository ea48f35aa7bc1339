"""Telemetry: what the gateway measures and exports.

Owns every metric name, label and bucket (``metrics.py``, ``labels.py``; their exposition, which
samples the dispatcher's live gauges, is the server's: ``gateway/server/exposition.py``), goodput
and its windows (``goodput.py``, ``window.py``), cost (``cost.py``, ``cost_meter.py``), traces
and their export (``tracing.py``, ``otlp.py``), and the request trace log (``tracelog.py``, with
the prompt signature it writes, ``prefix_signature.py``: keyed hashes of the prefix chain and
never text, computed by routing, ``gateway/routing/prefix_signature.py``).

Low in the stage order, imported by nearly every stage, and importing none above it: what it reads
of higher stages' values it declares itself, an answer's timing and usage (``token_stats.py``),
what goodput and cost read of a finished request (``goodput.JudgedRequest``,
``cost_meter.ChargedRequest``, both of which the pipeline's ``RequestOutcome`` is), and the one
role of a dialect the traces read (``api_identity.py``, composed into ``Dialect``).
"""
