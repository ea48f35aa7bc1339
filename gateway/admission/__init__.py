"""Admission: a parsed body becomes an ``InferenceRequest``, and the tenant's limits admit it.

Owns building the request (``build.py``: the body under the model's limits, with its dialect,
into an ``InferenceRequest``; the output bound, the model as the client called it) and the
tenant's limits (``tenant_limits.py``: the priority class, then rpm, tpm and concurrency through
``gateway/limitstore/``, settled with what the request really used).

May import everything up to ``gateway/types.py``: the request stage's field checks and estimate,
the dialects, the policy, the limit store, the errors. Never dispatch or the stages above it
(routing, fleet, upstream, pipeline, ...): they import this stage, not the other way round.
Why a stage of its own (issue 29): the request type holds its dialect, and the dialects use the
request stage's helpers, so whatever builds the type sits above both.
"""
