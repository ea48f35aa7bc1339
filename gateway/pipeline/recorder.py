"""Telemetry of a finished request, from one place: metrics, goodput, cost, trace log, span.

The pipeline hands every finished request here once, as a frozen ``RequestOutcome``
(``gateway/pipeline/outcome.py``); nothing else records per-request telemetry. Metric samples go
through ``Metrics.pending`` (applied in bulk before each scrape, see ``gateway/telemetry/metrics.py``),
so a request costs a few list appends here, not a lock per label set.

What is recorded where:

* ``gateway_requests_total{model,api,class,status,outcome}`` for every request, and
  ``gateway_rejections_total{reason,class,tenant}`` for every 429/503, under the tenant's
  bounded label (``gateway/telemetry/labels.py``);
* queue wait and routing decision of the last attempt, when one was dispatched;
* E2E, TTFT, inter-token gaps (``{model,api,class}``) and token counts
  (``{model,api,direction}``), when a backend answered;
* goodput (``gateway/telemetry/goodput.py``): SLO-judged requests, those that met it, and their tokens
  (``{model,api,class}``);
* the request's cost share (``gateway/telemetry/cost_meter.py``), its trace-log line
  (``gateway/telemetry/tracelog.py``) and its server span (``gateway/telemetry/tracing.py``).

The trace-log line's prefix signature and session hash (``gateway/routing/prefix_signature.py``) are
computed here, and only when a trace log is configured: without one no request pays the hashing.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.pipeline.context import RequestContext
from gateway.pipeline.outcome import RequestOutcome
from gateway.routing.isolation import tenant_scope
from gateway.routing.prefix_signature import request_session, request_signature, session_hash
from gateway.telemetry.cost_meter import CostMeter
from gateway.telemetry.goodput import judge_slo
from gateway.telemetry.labels import TenantLabels
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.prefix_signature import PrefixSignature
from gateway.telemetry.token_stats import TokenStats
from gateway.telemetry.tracelog import ItlSummary, TraceLog, trace_line
from gateway.telemetry.tracing import RequestSpan


class Recorder:
    """Records finished requests (see the module docstring); ``enabled=False`` records nothing."""

    def __init__(
        self,
        metrics: Metrics,
        costs: CostMeter,
        trace_log: TraceLog | None,
        *,
        epoch_offset: float,
        enabled: bool = True,
    ) -> None:
        self.metrics = metrics
        self.costs = costs
        self.trace_log = trace_log
        self.epoch_offset = epoch_offset
        self.enabled = enabled
        self.on_group_outcome: Callable[[RequestOutcome, bool | None], None] | None = None
        """Called with every finished request of a model group and whether it met its SLO (None:
        not judged): a rollout's canary observes its two arms through it (``gateway/rollout/``)."""

    def record(self, outcome: RequestOutcome, labels: TenantLabels) -> None:
        """Count ``outcome`` everywhere (once per request); ``labels`` bounds the tenant label."""
        if not self.enabled:
            return
        m = self.metrics
        p = m.pending
        model, api, class_name = outcome.model, outcome.api.name, outcome.class_name
        model_class = (model, class_name)
        model_api_class = (model, api, class_name)
        label = outcome.label
        p.inc(m.requests, (model, api, class_name, str(outcome.status), label))
        tenant = labels.label(outcome.tenant)  # counts traffic; the busiest keep their name
        if outcome.status in (429, 503):
            p.inc(m.rejections, (label, class_name, tenant))
        decision = outcome.decision
        if decision is not None:
            p.observe(m.queue_wait, model_class, outcome.queued_s)
            strategy = decision.strategy
            p.inc(m.routing_decisions, (model, strategy, decision.reason))
            p.observe(m.routing_pick, (model, strategy), decision.pick_s)
            if decision.detail is not None:
                p.observe(m.matched_blocks, (model, strategy), decision.matched_blocks)
                p.inc(m.routing_prefix_source, (model, "events" if decision.engine_reported else "estimate"))
        verdict = judge_slo(outcome)
        tokens = outcome.tokens
        if verdict.judged:
            p.inc(m.slo_requests, model_api_class)
            if verdict.met:
                output = (tokens.usage_int("completion_tokens") or 0) if tokens else 0
                p.inc(m.goodput_requests, model_api_class)
                p.inc(m.goodput_tokens, model_api_class, output)
        self.costs.charge(outcome, tenant, verdict.met)
        ctx = outcome.context
        if ctx is not None and ctx.route.group is not None:
            route = ctx.route
            p.inc(m.group_requests, (route.public_name, route.primary.name, route.role))
            if self.on_group_outcome is not None:
                self.on_group_outcome(outcome, verdict.met if verdict.judged else None)
        itl = ItlSummary.of(tokens.gaps) if tokens and tokens.gaps else None
        if self.trace_log is not None:
            self._write_trace_log(self.trace_log, outcome, itl, verdict.met)
        if outcome.span.recording:
            finish_span(outcome.span, outcome, itl)
        if tokens is None:
            return
        p.observe(m.e2e, model_api_class, outcome.e2e_s)
        ttft = tokens.ttft
        if ttft is not None:
            p.observe(m.ttft, model_api_class, ttft)
            if tokens.gaps:
                p.observe_all(m.itl, model_api_class, tokens.gaps)
        if tokens.usage:
            p.inc(m.tokens, (model, api, "input"), tokens.usage_int("prompt_tokens") or 0)
            p.inc(m.tokens, (model, api, "output"), tokens.usage_int("completion_tokens") or 0)
        cache = outcome.cache
        if cache is not None:
            backend = (outcome.backend, model)
            p.inc(m.predicted_cached_tokens, backend, cache.predicted_tokens)
            p.inc(m.confirmed_cached_tokens, backend, cache.confirmed_tokens)
            p.inc(m.engine_cached_tokens, backend, cache.cached_tokens)
            p.inc(m.engine_computed_prompt_tokens, backend, cache.computed_tokens)
            if cache.missed:
                p.inc(m.prefix_cache_misses, backend, 1)

    def _write_trace_log(self, log: TraceLog, outcome: RequestOutcome, itl: ItlSummary | None, met: bool) -> None:
        """One line of the request trace log (no prompt or completion text, ever)."""
        tokens = outcome.tokens
        ctx = outcome.context
        log.write(
            trace_line(
                request_id=outcome.request_id,
                epoch_offset=self.epoch_offset,
                t_arrival=outcome.arrival,
                t_end=outcome.end,
                t_admit=outcome.t_admit,
                t_dispatch=outcome.t_dispatch,
                t_first_token=tokens.first_output if tokens else None,
                class_name=outcome.class_name,
                tenant=outcome.tenant,
                model=outcome.model,
                stream=outcome.stream,
                status=outcome.status,
                outcome=outcome.label,
                backend=outcome.backend,
                queue_s=outcome.queued_s,
                itl=itl,
                tokens_in=tokens.usage_int("prompt_tokens") if tokens else None,
                tokens_out=tokens.usage_int("completion_tokens") if tokens else None,
                cached_tokens=tokens.cached_tokens if tokens else None,
                predicted_cached_tokens=outcome.cache.predicted_tokens if outcome.cache else None,
                slo_met=met,
                engine_request_ids=[attempt.engine_request_id for attempt in outcome.attempts],
                api=outcome.api.name,
                max_tokens=ctx.request.max_tokens if ctx else None,
                signature=signature_of(ctx) if ctx else None,
                session=hashed_session(ctx) if ctx else None,
            )
        )


def signature_of(ctx: RequestContext) -> PrefixSignature:
    """The request's prefix signature under its tenant's cache scope, its model's block size and the
    runtime's cache-salt secret (the router's keys reused unless the model routes with a
    configured tokenizer)."""
    routing = ctx.runtime.snapshot.models[ctx.request.model].routing
    reuse = routing.tokenizer == "estimate"
    scope = tenant_scope(ctx.tenant)
    return request_signature(
        ctx.request, scope, routing.block_tokens, secret=ctx.runtime.prefix_secret, reuse_keys=reuse
    )


def hashed_session(ctx: RequestContext) -> str | None:
    session = request_session(ctx.request)
    return None if session is None else session_hash(ctx.tenant.name, session)


def finish_span(span: RequestSpan, outcome: RequestOutcome, itl: ItlSummary | None) -> None:
    """End a request's server span: its first-token event, usage, TTFT and ITL summary."""
    tokens: TokenStats | None = outcome.tokens
    if tokens is None:
        span.finish(t=outcome.end, status=outcome.status, outcome=outcome.label)
        return
    if tokens.first_output is not None:
        span.first_token(t=tokens.first_output)
    span.finish(
        t=outcome.end,
        status=outcome.status,
        outcome=outcome.label,
        input_tokens=tokens.usage_int("prompt_tokens"),
        output_tokens=tokens.usage_int("completion_tokens"),
        cached_tokens=tokens.cached_tokens,
        predicted_cached_tokens=outcome.cache.predicted_tokens if outcome.cache else None,
        finish_reasons=tokens.finish_reasons,
        ttft_s=tokens.ttft,
        itl=itl,
    )
