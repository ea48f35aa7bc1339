"""OpenTelemetry traces of the request path: one server span per request, cheap when off.

Why traces on top of metrics and the trace log: a slow request is slow *somewhere* (in the
queue, in routing, on one of several upstream attempts, before the first token) and the
backend's own spans (vLLM exports OTel too) join the gateway's through the W3C
``traceparent`` header this module injects into every upstream request.

Shape of a request's trace (times come from the gateway's monotonic clock and are turned
into epoch nanoseconds with ``epoch_offset``, so spans can be recorded after the fact)::

    chat test/chat            SERVER  gen_ai.* request/usage attributes, TTFT, ITL percentiles
      ├─ queue  (only when it waited)  gateway.queue_s, gateway.class
      ├─ route                        gateway.backend, strategy, reason, matched blocks, scores
      ├─ upstream b1  (attempt 1)  CLIENT  http.response.status_code, error.type
      └─ upstream b2  (attempt 2)  CLIENT
      event "first_token" on the server span

Attribute names follow the OpenTelemetry GenAI semantic conventions (constants below);
the gateway's own are under ``gateway.``. No prompt or completion text is recorded unless
``TracingConfig.capture_content`` opts in.

Cost: with ``enabled=False`` ``start_request`` returns one shared inert ``RequestSpan``
whose methods return at their first line; no span, context or attribute dict is created.
With tracing on, spans go to a ``BatchSpanProcessor`` whose thread does the exporting.

Usage::

    tracing = Tracing(TracingConfig.from_env(), epoch_offset=time.time() - clock.now())
    span = tracing.start_request(t=arrival, request_id=rid, api=Api.CHAT, traceparent=hdr)
    span.describe(model=..., tenant=..., class_name=..., max_tokens=..., stream=True)
    attempt = span.attempt(backend="b1", number=1, t=clock.now())
    attempt.inject(upstream_headers)          # adds traceparent
    attempt.end(t=clock.now(), status=200)
    span.finish(t=clock.now(), status=200, outcome="completed", ...)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Annotated

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from pydantic import BaseModel, ConfigDict, Field

from gateway.tracelog import ItlSummary
from gateway.types import Api

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
ERROR_TYPE = "error.type"
# The gateway's own.
REQUEST_ID = "gateway.request_id"
TENANT = "gateway.tenant"
CLASS = "gateway.class"
OUTCOME = "gateway.outcome"
BACKEND = "gateway.backend"
ATTEMPT = "gateway.attempt"
QUEUE_S = "gateway.queue_s"
ROUTING_STRATEGY = "gateway.routing.strategy"
ROUTING_REASON = "gateway.routing.reason"
ROUTING_MATCHED_BLOCKS = "gateway.routing.matched_blocks"
ROUTING_CANDIDATES = "gateway.routing.candidates"
ROUTING_SCORES = "gateway.routing.scores"
TTFT_S = "gateway.ttft_s"
ITL_P50_S = "gateway.itl.p50_s"
ITL_P99_S = "gateway.itl.p99_s"
ITL_MAX_S = "gateway.itl.max_s"
ITL_MEAN_S = "gateway.itl.mean_s"
FIRST_TOKEN_EVENT = "first_token"
MIN_QUEUE_SPAN_S = 0.001

OPERATION_NAMES = {Api.CHAT: "chat", Api.COMPLETIONS: "text_completion", Api.EMBEDDINGS: "embeddings"}


class TracingConfig(BaseModel):
    """Whether to trace, how much, and where to: ``TracingConfig(enabled=True, sampling_ratio=0.1)``.

    ``endpoint`` is the OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); when
    None the exporter reads ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    sampling_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    endpoint: str | None = None
    service_name: str = "inference-gateway"
    capture_content: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        """The standard variables: on when an OTLP endpoint is set and the SDK is not disabled."""
        env = os.environ if env is None else env
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        disabled = env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER") == "none"
        ratio = env.get("OTEL_TRACES_SAMPLER_ARG")
        return cls(
            enabled=bool(endpoint or generic) and not disabled,
            sampling_ratio=float(ratio) if ratio else 1.0,
            endpoint=endpoint or (generic.rstrip("/") + "/v1/traces" if generic else None),
            service_name=env.get("OTEL_SERVICE_NAME", "inference-gateway"),
        )


class AttemptSpan:
    """One upstream attempt (a CLIENT span); the inert one does nothing."""

    __slots__ = ("_offset", "_span")

    def __init__(self, span: Span | None, offset: float) -> None:
        self._span = span
        self._offset = offset

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add ``traceparent`` (and ``tracestate``) naming this attempt as the backend's parent."""
        if self._span is None:
            return
        propagate.inject(headers, context=trace.set_span_in_context(self._span))

    def end(self, *, t: float, status: int = 0, error: str | None = None) -> None:
        span = self._span
        if span is None:
            return
        if status:
            span.set_attribute(HTTP_RESPONSE_STATUS_CODE, status)
        if error is not None:
            span.set_attribute(ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=_ns(t, self._offset))


class RequestSpan:
    """The server span of one request and the recorders of its children; the inert one does nothing."""

    __slots__ = ("_capture", "_offset", "_operation", "_span", "_tracer")

    def __init__(
        self, span: Span | None, tracer: trace.Tracer | None, offset: float, capture: bool, operation: str = ""
    ) -> None:
        self._span = span
        self._tracer = tracer
        self._offset = offset
        self._capture = capture
        self._operation = operation

    @property
    def recording(self) -> bool:
        return self._span is not None and self._span.is_recording()

    def describe(self, *, model: str, tenant: str, class_name: str, max_tokens: int | None, stream: bool) -> None:
        span = self._span
        if span is None:
            return
        span.update_name(f"{self._operation} {model}")
        span.set_attributes(
            {GEN_AI_REQUEST_MODEL: model, TENANT: tenant, CLASS: class_name, GEN_AI_REQUEST_STREAM: stream}
        )
        if max_tokens is not None:
            span.set_attribute(GEN_AI_REQUEST_MAX_TOKENS, max_tokens)

    def queue(self, *, start: float, end: float, class_name: str) -> None:
        """The wait for a backend with room, recorded once granted.

        On the fast path (no wait, under ``MIN_QUEUE_SPAN_S``) only the server span's
        ``gateway.queue_s`` is set: a child span costs ~50 µs and would say nothing.
        """
        span = self._span
        if span is None:
            return
        span.set_attribute(QUEUE_S, end - start)
        if end - start < MIN_QUEUE_SPAN_S:
            return
        self._child("queue", start, SpanKind.INTERNAL, {QUEUE_S: end - start, CLASS: class_name}).end(
            end_time=_ns(end, self._offset)
        )

    def route(
        self,
        *,
        start: float,
        end: float,
        backend: str,
        strategy: str,
        reason: str,
        matched_blocks: int = 0,
        scores: Mapping[str, float] | None = None,
    ) -> None:
        """The routing decision: the chosen backend, why, and every candidate's score."""
        if self._span is None:
            return
        attributes: dict[str, AttributeValue] = {
            BACKEND: backend,
            ROUTING_STRATEGY: strategy,
            ROUTING_REASON: reason,
            ROUTING_MATCHED_BLOCKS: matched_blocks,
        }
        if scores:
            attributes[ROUTING_CANDIDATES] = list(scores)
            attributes[ROUTING_SCORES] = [float(v) for v in scores.values()]
        self._span.set_attribute(BACKEND, backend)
        self._child("route", start, SpanKind.INTERNAL, attributes).end(end_time=_ns(end, self._offset))

    def attempt(self, *, backend: str, number: int, t: float) -> AttemptSpan:
        if self._span is None:
            return _INERT_ATTEMPT
        span = self._child(f"upstream {backend}", t, SpanKind.CLIENT, {BACKEND: backend, ATTEMPT: number})
        return AttemptSpan(span, self._offset)

    def first_token(self, *, t: float) -> None:
        span = self._span
        if span is None:
            return
        span.add_event(FIRST_TOKEN_EVENT, timestamp=_ns(t, self._offset))

    def content(self, *, input_messages: str, output_messages: str) -> None:
        """Prompt and completion (JSON text): recorded only when ``capture_content`` opts in."""
        if self._span is None or not self._capture:
            return
        self._span.set_attributes({GEN_AI_INPUT_MESSAGES: input_messages, GEN_AI_OUTPUT_MESSAGES: output_messages})

    def finish(
        self,
        *,
        t: float,
        status: int,
        outcome: str,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        response_model: str | None = None,
        ttft_s: float | None = None,
        itl: ItlSummary | None = None,
    ) -> None:
        span = self._span
        if span is None:
            return
        attributes: dict[str, AttributeValue] = {HTTP_RESPONSE_STATUS_CODE: status, OUTCOME: outcome}
        optional: dict[str, str | int | float | None] = {
            GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
            GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached_tokens,
            GEN_AI_RESPONSE_MODEL: response_model,
            TTFT_S: ttft_s,
            GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: ttft_s,
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        if finish_reasons:
            attributes[GEN_AI_RESPONSE_FINISH_REASONS] = list(finish_reasons)
        if itl is not None:
            attributes.update({ITL_P50_S: itl.p50, ITL_P99_S: itl.p99, ITL_MAX_S: itl.max, ITL_MEAN_S: itl.mean})
        span.set_attributes(attributes)
        if outcome != "completed":
            span.set_attribute(ERROR_TYPE, outcome)
            if status >= 500 or status == 0:
                span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=_ns(t, self._offset))

    def _child(self, name: str, start: float, kind: SpanKind, attributes: Mapping[str, AttributeValue]) -> Span:
        assert self._tracer is not None
        assert self._span is not None
        return self._tracer.start_span(
            name,
            context=trace.set_span_in_context(self._span),
            kind=kind,
            attributes=attributes,
            start_time=_ns(start, self._offset),
        )


_INERT_ATTEMPT = AttemptSpan(None, 0.0)
_INERT_REQUEST = RequestSpan(None, None, 0.0, False)


class Tracing:
    """The gateway's ``TracerProvider`` (its own, never the process-global one) and span factory."""

    def __init__(self, config: TracingConfig, *, epoch_offset: float, exporter: SpanExporter | None = None) -> None:
        """``exporter`` replaces OTLP (tests pass an ``InMemorySpanExporter``, exported synchronously)."""
        self.config = config
        self.enabled = config.enabled
        self._offset = epoch_offset
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if not config.enabled:
            return
        sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": config.service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer("gateway")

    def start_request(self, *, t: float, request_id: str, api: Api, traceparent: str | None = None) -> RequestSpan:
        """The server span of a request arriving at ``t``; the client's ``traceparent`` is its parent."""
        tracer = self._tracer
        if tracer is None:
            return _INERT_REQUEST
        parent = propagate.extract({"traceparent": traceparent}) if traceparent else None
        operation = OPERATION_NAMES[api]
        span = tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={GEN_AI_OPERATION_NAME: operation, REQUEST_ID: request_id},
            start_time=_ns(t, self._offset),
        )
        return RequestSpan(span, tracer, self._offset, self.config.capture_content, operation)

    def shutdown(self) -> None:
        """Flush what is pending and stop the exporter thread (call at shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()


def _ns(t: float, offset: float) -> int:
    return int((t + offset) * 1e9)
