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
whose methods return at their first line. With tracing on, a sampled request encodes as it
goes: each attribute becomes its OTLP protobuf field when recorded (a table lookup), each child
span its bytes when it ends, and ``finish`` adds the server span and queues the lot for the
export thread of ``gateway/telemetry/otlp.py`` (which says why the SDK's own span pipeline is not used).
A request that is not sampled records nothing but still passes its trace on (``traceparent``
with the sampled flag off).

A client's ``traceparent`` is *linked*, not followed: the request's span starts a trace of
the gateway's own, sampled by the gateway's own ratio, with a span link to the client's span
(trace viewers navigate from one to the other). Following it would let any client decide the
gateway's sampling (a sampled flag on every request forces 100% tracing, a cost the operator
never chose) and graft spans into a trace id the client picked.

Usage::

    tracing = Tracing(TracingConfig.from_env(), epoch_offset=time.time() - clock.now())
    span = tracing.start_request(t=arrival, request_id=rid, api=CHAT, traceparent=hdr)
    span.describe(model=..., tenant=..., class_name=..., max_tokens=..., stream=True)
    attempt = span.attempt(backend="b1", number=1, t=clock.now())
    attempt.inject(upstream_headers)          # adds traceparent
    attempt.engine_request("gw-...")          # the id the engine got; upstream_fault(...) on failure
    attempt.end(t=clock.now(), status=200)
    span.finish(t=clock.now(), status=200, outcome="completed", ...)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, MutableMapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.policy.model import TracingConfig
from gateway.telemetry.api_identity import ApiIdentity
from gateway.telemetry.otlp import (
    SPAN_KIND_CLIENT,
    SPAN_KIND_INTERNAL,
    SPAN_KIND_SERVER,
    AttributeValue,
    BatchExporter,
    HttpSender,
    Sender,
    SpanEncoder,
)
from gateway.telemetry.tracelog import ItlSummary

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
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
HTTP_ROUTE = "http.route"  # the API's path (HTTP semantic conventions): /v1/messages, /v1/responses, ...
ERROR_TYPE = "error.type"
# The gateway's own.
REQUEST_ID = "gateway.request_id"
API = "gateway.api"  # the API's short name, as the ``api`` label of the metrics (chat, responses, messages, ...)
TENANT = "gateway.tenant"
CLASS = "gateway.class"
OUTCOME = "gateway.pipeline.outcome"
BACKEND = "gateway.backend"
ATTEMPT = "gateway.pipeline.attempt"
QUEUE_S = "gateway.queue_s"
ROUTING_STRATEGY = "gateway.routing.strategy"
ROUTING_REASON = "gateway.routing.reason"
ROUTING_MATCHED_BLOCKS = "gateway.routing.matched_blocks"
PREDICTED_CACHED_TOKENS = "gateway.routing.predicted_cached_tokens"  # beside the engine's own cache_read figure
ROUTING_CANDIDATES = "gateway.routing.candidates"
ROUTING_SCORES = "gateway.routing.scores"
ITL_P50_S = "gateway.itl.p50_s"
ITL_P99_S = "gateway.itl.p99_s"
ITL_MAX_S = "gateway.itl.max_s"
ITL_MEAN_S = "gateway.itl.mean_s"
ENGINE_REQUEST_ID = "gateway.engine_request_id"  # the id the engine got for this attempt (not the client's)
UPSTREAM_STATUS = "gateway.upstream.client.status"  # what a failed backend answered (never shown to the client)
UPSTREAM_ERROR_EXCERPT = "gateway.upstream.client.error_excerpt"  # sanitised, bounded (gateway/upstream/errors.py)
FIRST_TOKEN_EVENT = "first_token"
MIN_QUEUE_SPAN_S = 0.001

_PROPAGATOR = TraceContextTextMapPropagator()
_random_bits = random.getrandbits
_ID_MASK = (1 << 64) - 1


def _new_id(bits: int) -> int:
    while not (value := _random_bits(bits)):
        pass
    return value


def _traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class AttemptSpan:
    """One upstream attempt (a CLIENT span), encoded when it ends; the inert one does nothing."""

    __slots__ = ("_attributes", "_name", "_request", "_start", "ended", "span_id")

    def __init__(
        self,
        request: RequestSpan | None,
        span_id: int,
        start: float,
        attributes: list[bytes] | None,
        name: str = "",
    ) -> None:
        self._request = request
        self.span_id = span_id
        self._start = start
        self._name = name
        self._attributes = attributes  # None: not recorded (unsampled or inert)
        self.ended = False

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add ``traceparent`` naming this attempt as the backend's parent."""
        request = self._request
        if request is not None:
            headers["traceparent"] = _traceparent(request.trace_id, self.span_id, request.sampled)

    def engine_request(self, engine_request_id: str) -> None:
        """The request id this attempt gave the engine (``gateway.upstream.client.new_engine_request_id``)."""
        attributes = self._attributes
        if attributes is not None and self._request is not None:
            attributes.append(self._request.field(ENGINE_REQUEST_ID, engine_request_id))

    def upstream_fault(self, *, status: int, excerpt: str) -> None:
        """What the backend said when it failed: its status and a sanitised excerpt, for the operator."""
        attributes, request = self._attributes, self._request
        if attributes is not None and request is not None:
            attributes += (request.field(UPSTREAM_STATUS, status), request.field(UPSTREAM_ERROR_EXCERPT, excerpt))

    def end(self, *, t: float, status: int = 0, error: str | None = None) -> None:
        """Close the span (once); it joins its request's trace, sent when the request finishes."""
        attributes, request = self._attributes, self._request
        if attributes is None or request is None or self.ended:
            return
        self.ended = True
        if status:
            attributes.append(request.field(HTTP_RESPONSE_STATUS_CODE, status))
        if error is not None:
            attributes.append(request.field(ERROR_TYPE, error))
        request.child(self.span_id, self._name, SPAN_KIND_CLIENT, self._start, t, attributes, error is not None)


class RequestSpan:
    """The server span of one request and the recorders of its children; the inert one does nothing.

    A sampled request encodes as it goes: each attribute becomes its encoded field when it is
    recorded (one lookup, ``SpanEncoder.attributes``), each child span its bytes when it ends, and
    ``finish`` encodes the server span and hands the lot to the exporter. Nothing is built twice
    and no intermediate record outlives its step. Unsampled requests only carry ids for propagation.
    """

    __slots__ = (
        "_attempts",
        "_attributes",
        "_backend",
        "_capture",
        "_children",
        "_encoder",
        "_events",
        "_links",
        "_name",
        "_queue_s",
        "_start",
        "_trace_words",
        "_tracing",
        "sampled",
        "span_id",
        "trace_id",
    )

    def __init__(
        self,
        tracing: Tracing | None,
        trace_id: int,
        span_id: int,
        encoder: SpanEncoder | None = None,
        *,
        name: str = "",
        start: float = 0.0,
        attributes: list[bytes] | None = None,
        links: tuple[tuple[int, int], ...] = (),
        capture: bool = False,
    ) -> None:
        self._tracing = tracing
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = attributes is not None
        self._encoder = encoder
        self._attributes = attributes
        if attributes is None:  # unsampled: only the ids, to propagate; every method returns at once
            return
        self._trace_words = (trace_id >> 64, trace_id & _ID_MASK)
        self._name = name
        self._start = start
        self._links = links
        self._capture = capture
        self._children: list[bytes] = []
        self._attempts: list[AttemptSpan] = []
        self._events: list[tuple[str, float]] = []
        self._backend: str | None = None
        self._queue_s: float | None = None

    @property
    def recording(self) -> bool:
        return self._attributes is not None

    def field(self, key: str, value: AttributeValue) -> bytes:
        """The encoded attribute (sampled requests only)."""
        assert self._encoder is not None
        return self._encoder.attributes[key][value]

    def child(
        self, span_id: int, name: str, kind: int, start: float, end: float, attributes: list[bytes], error: bool = False
    ) -> None:
        """Encode a finished child span into this request's trace."""
        if self._attributes is not None and self._encoder is not None:
            self._children.append(
                self._encoder.span(
                    self._trace_words, span_id, self.span_id, name, kind, start, end, attributes, error=error
                )
            )

    def describe(self, *, model: str, tenant: str, class_name: str, max_tokens: int | None, stream: bool) -> None:
        attributes, encoder = self._attributes, self._encoder
        if attributes is None or encoder is None:
            return
        self._name = f"{self._name} {model}"
        tables = encoder.attributes
        attributes += (
            tables[GEN_AI_REQUEST_MODEL][model],
            tables[TENANT][tenant],
            tables[CLASS][class_name],
            tables[GEN_AI_REQUEST_STREAM][stream],
        )
        if max_tokens is not None:
            attributes.append(tables[GEN_AI_REQUEST_MAX_TOKENS][max_tokens])

    def queue(self, *, start: float, end: float, class_name: str) -> None:
        """The wait for a backend with room, recorded once granted.

        On the fast path (no wait, under ``MIN_QUEUE_SPAN_S``) only the server span's
        ``gateway.queue_s`` is set: a child span would say nothing.
        """
        if self._attributes is None:
            return
        waited = self._queue_s = end - start
        if waited >= MIN_QUEUE_SPAN_S:
            attributes = [self.field(QUEUE_S, waited), self.field(CLASS, class_name)]
            self.child(_new_id(64), "queue", SPAN_KIND_INTERNAL, start, end, attributes)

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
        if self._attributes is None or self._encoder is None:
            return
        tables = self._encoder.attributes
        attributes = [
            tables[BACKEND][backend],
            tables[ROUTING_STRATEGY][strategy],
            tables[ROUTING_REASON][reason],
            tables[ROUTING_MATCHED_BLOCKS][matched_blocks],
        ]
        if scores:
            attributes += (
                tables[ROUTING_CANDIDATES][tuple(scores)],
                tables[ROUTING_SCORES][tuple([float(v) for v in scores.values()])],
            )
        self._backend = backend
        self.child(_new_id(64), "route", SPAN_KIND_INTERNAL, start, end, attributes)

    def attempt(self, *, backend: str, number: int, t: float) -> AttemptSpan:
        if self._tracing is None:
            return INERT_ATTEMPT
        span_id = _new_id(64)
        if self._attributes is None:
            return AttemptSpan(self, span_id, t, None)
        attributes = [self.field(BACKEND, backend), self.field(ATTEMPT, number)]
        attempt = AttemptSpan(self, span_id, t, attributes, f"upstream {backend}")
        self._attempts.append(attempt)
        return attempt

    def first_token(self, *, t: float) -> None:
        if self._attributes is not None:
            self._events.append((FIRST_TOKEN_EVENT, t))

    def content(self, *, input_messages: str, output_messages: str) -> None:
        """Prompt and completion (JSON text): recorded only when ``capture_content`` opts in."""
        attributes = self._attributes
        if attributes is None or not self._capture:
            return
        attributes += (
            self.field(GEN_AI_INPUT_MESSAGES, input_messages),
            self.field(GEN_AI_OUTPUT_MESSAGES, output_messages),
        )

    def finish(
        self,
        *,
        t: float,
        status: int,
        outcome: str,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
        predicted_cached_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        response_model: str | None = None,
        ttft_s: float | None = None,
        itl: ItlSummary | None = None,
    ) -> None:
        attributes, encoder = self._attributes, self._encoder
        if attributes is None or encoder is None or self._tracing is None:
            return
        for attempt in self._attempts:
            if not attempt.ended:  # an attempt cut short (the client left): it ends with the request
                attempt.end(t=t)
        self._attempts = []  # they point back here: no cycle left for the collector
        self._attributes = None  # finished once
        tables = encoder.attributes
        attributes += (tables[HTTP_RESPONSE_STATUS_CODE][status], tables[OUTCOME][outcome])
        if self._backend is not None:
            attributes.append(tables[BACKEND][self._backend])
        if self._queue_s is not None:
            attributes.append(tables[QUEUE_S][self._queue_s])
        if input_tokens is not None:
            attributes.append(tables[GEN_AI_USAGE_INPUT_TOKENS][input_tokens])
        if output_tokens is not None:
            attributes.append(tables[GEN_AI_USAGE_OUTPUT_TOKENS][output_tokens])
        if cached_tokens is not None:
            attributes.append(tables[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS][cached_tokens])
        if predicted_cached_tokens is not None:
            attributes.append(tables[PREDICTED_CACHED_TOKENS][predicted_cached_tokens])
        if response_model is not None:
            attributes.append(tables[GEN_AI_RESPONSE_MODEL][response_model])
        if ttft_s is not None:  # the TTFT, under its GenAI name
            attributes.append(tables[GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK][ttft_s])
        if finish_reasons:
            attributes.append(tables[GEN_AI_RESPONSE_FINISH_REASONS][tuple(finish_reasons)])
        if itl is not None:
            attributes += (
                tables[ITL_P50_S][itl.p50],
                tables[ITL_P99_S][itl.p99],
                tables[ITL_MAX_S][itl.max],
                tables[ITL_MEAN_S][itl.mean],
            )
        error = False
        if outcome != "completed":
            attributes.append(tables[ERROR_TYPE][outcome])
            error = status >= 500 or status == 0
        server = encoder.span(
            self._trace_words, self.span_id, 0, self._name, SPAN_KIND_SERVER, self._start, t, attributes,
            self._events, self._links, error,
        )  # fmt: skip
        self._tracing.submit(b"".join([server, *self._children]), 1 + len(self._children))


INERT_ATTEMPT = AttemptSpan(None, 0, 0.0, None)
INERT_REQUEST = RequestSpan(None, 0, 0)


class Tracing:
    """Span factory and exporter of the gateway's traces (never the process-global tracer)."""

    def __init__(
        self,
        config: TracingConfig,
        *,
        epoch_offset: float,
        sender: Sender | None = None,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        """``sender`` replaces the OTLP/HTTP POST (tests pass one and call ``flush``)."""
        self.config = config
        self.enabled = config.enabled
        self._exporter: BatchExporter | None = None
        self._encoder: SpanEncoder | None = None
        self._bound = TraceIdRatioBased.get_bound_for_rate(config.sampling_ratio)
        if not config.enabled:
            return
        resource = Resource.create({"service.name": config.service_name})
        encoder = SpanEncoder(
            dict(resource.attributes),  # type: ignore[arg-type]
            "gateway",
            epoch_offset,
            unique_keys=frozenset(
                {REQUEST_ID, ENGINE_REQUEST_ID, UPSTREAM_ERROR_EXCERPT, GEN_AI_INPUT_MESSAGES, GEN_AI_OUTPUT_MESSAGES}
            ),
        )
        self._encoder = encoder
        if sender is None:
            endpoint = config.endpoint or "http://localhost:4318/v1/traces"
            sender = HttpSender(endpoint, config.headers)
            self._exporter = BatchExporter(encoder, sender, on_dropped=on_dropped)
        else:
            self._exporter = BatchExporter(encoder, sender, on_dropped=on_dropped, background=False)

    def start_request(
        self, *, t: float, request_id: str, api: ApiIdentity, traceparent: str | None = None
    ) -> RequestSpan:
        """The server span of a request arriving at ``t``; the client's ``traceparent`` is linked."""
        if self._exporter is None:
            return INERT_REQUEST
        trace_id = _new_id(128)
        sampled = (trace_id & _ID_MASK) < self._bound
        span_id = _new_id(64)
        if not sampled:
            return RequestSpan(self, trace_id, span_id)
        operation = api.operation
        encoder = self._encoder
        tables = encoder.attributes  # type: ignore[union-attr]
        attributes = [
            tables[GEN_AI_OPERATION_NAME][operation],
            tables[API][api.name],
            tables[HTTP_ROUTE][api.path],
            tables[REQUEST_ID][request_id],
        ]
        client = _client_context(traceparent) if traceparent else None
        return RequestSpan(
            self, trace_id, span_id, encoder, name=operation, start=t, attributes=attributes,
            links=(client,) if client is not None else (), capture=self.config.capture_content,
        )  # fmt: skip

    def submit(self, encoded: bytes, spans: int) -> None:
        """A finished request's encoded spans, to the export queue."""
        if self._exporter is not None:
            self._exporter.submit(encoded, spans)

    def flush(self) -> None:
        """Send every finished trace now (tests; shutdown does it too)."""
        if self._exporter is not None:
            self._exporter.flush()

    def shutdown(self) -> None:
        """Flush what is pending and stop the export thread (call at shutdown)."""
        if self._exporter is not None:
            self._exporter.shutdown()


def _client_context(traceparent: str) -> tuple[int, int] | None:
    """The client's trace id and span id (W3C Trace Context), if valid."""
    context = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent})).get_span_context()
    if not context.is_valid:
        return None
    return context.trace_id, context.span_id
