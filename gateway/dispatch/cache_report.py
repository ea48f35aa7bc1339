"""What an engine says it reused of a prompt, beside what the router expected it to hold.

Why: prefix-affinity routing acts on a belief (``gateway/routing/prefix_index.py``: the blocks a
backend was sent lately, evicted by an LRU the gateway sizes itself). The engine knows what it
really reused, and says so in every answer's usage (``prompt_tokens_details.cached_tokens``:
vLLM with ``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``, llama.cpp
always, or in its ``timings.cache_n``, which the dialects fold into the same field). Reading it on
every answer turns the belief into a measured prediction (``gateway_predicted_cached_tokens_total``
against ``gateway_engine_cached_tokens_total``) and lets the router correct itself when the engine
had less than it thought (``CacheReport.missed``: ``gateway/routing/prefix_affinity.py``,
``on_answer``).

Units: the router counts blocks of its own chain (``routing.block_tokens`` tokens of the gateway's
estimate each); the engine counts its own tokens. The prediction is put in the engine's tokens by
the matched share of the chain: ``matched / prompt_blocks × the engine's prompt tokens``.

An engine that never sent the field (vLLM without the flag) is unknown: no report. vLLM leaves the
field out (``null`` in a whole answer, absent in a stream) when it reused nothing, so once a backend
has sent the field its silence means 0 (``BackendState.reports_cached``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.dispatch.router import CacheReport, RoutingDecision

__all__ = ["MISS_SLACK_BLOCKS", "CacheReport", "cache_report", "reported_cached_tokens"]

MISS_SLACK_BLOCKS = 2
"""Blocks (the router's) the engine may hold fewer than predicted without it counting as a miss:
one for the engine's own block rounding (it caches whole blocks of its own, vLLM never the
prompt's last token: a 175-token prompt is 160 cached tokens with 16-token blocks), one for the
router's block boundaries, which fall on its estimate of the tokens rather than the engine's."""


def reported_cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``; None when the engine did not say."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached >= 0 else None


def cache_report(decision: RoutingDecision, usage: Mapping[str, Any] | None) -> CacheReport | None:
    """The answer's cache figures, or None when the engine's figures are unknown (no usage, no
    prompt count, or a backend that never reports cached tokens). Notes on the backend that it
    reports them, the first time it does."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int) or prompt <= 0:
        return None
    state = decision.state
    cached = reported_cached_tokens(usage)
    if cached is None:
        if not state.reports_cached:
            return None
        cached = 0
    else:
        state.reports_cached = True
    cached = min(cached, prompt)
    detail = decision.detail
    blocks = detail.prompt_blocks if detail is not None else 0
    matched = min(decision.matched_blocks, blocks)
    if not blocks or not matched:
        return CacheReport(0, cached, prompt, False)
    missed = cached * blocks < (matched - MISS_SLACK_BLOCKS) * prompt  # held fewer blocks than that
    return CacheReport(matched * prompt // blocks, cached, prompt, missed)
