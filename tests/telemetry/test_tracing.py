"""OpenTelemetry spans of a request: shape, GenAI attributes, propagation, sampling, and the off switch."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.dialects.chat import CHAT
from gateway.dialects.embeddings import EMBEDDINGS
from gateway.policy.model import TracingConfig
from gateway.telemetry import tracing as t
from gateway.telemetry.otlp import MAX_VALUES_PER_KEY, AttributeValue, SpanEncoder
from gateway.telemetry.tracelog import ItlSummary
from gateway.telemetry.tracing import Tracing
from loadtests.harness.otlp_sink import OtlpSink, SinkSpan, decode, resource_of
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy, traces_to
from tests.servers import serve_in_thread, wait_until

EPOCH = 1_700_000_000.0
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-b7ad6b7169203331-01"
SERVER, CLIENT, ERROR = 2, 3, 2  # OTLP's SPAN_KIND_SERVER, SPAN_KIND_CLIENT, STATUS_CODE_ERROR


class Collector:
    """Stands for the collector: keeps each export request's protobuf bytes."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def __call__(self, body: bytes) -> None:
        self.bodies.append(body)

    def spans(self) -> list[SinkSpan]:
        return [span for body in self.bodies for span in decode(body)]


@pytest.fixture
def exporter() -> Collector:
    return Collector()


def traced(exporter: Collector, **config: object) -> Tracing:
    return Tracing(TracingConfig(enabled=True, **config), epoch_offset=EPOCH, sender=exporter)  # type: ignore[arg-type]


def run_request(tracing: Tracing, traceparent: str | None = None) -> dict[str, str]:
    """One streamed request through every recorder; returns the headers sent upstream."""
    span = tracing.start_request(t=10.0, request_id="req-1", api=CHAT, traceparent=traceparent)
    span.describe(model="test/chat", tenant="acme", class_name="interactive", max_tokens=16, stream=True)
    span.queue(start=10.001, end=10.25, class_name="interactive")
    span.route(
        start=10.25, end=10.2501, backend="b1", strategy="prefix", reason="prefix_match", matched_blocks=3,
        scores={"b1": 0.9, "b2": 0.4},
    )  # fmt: skip
    failed = span.attempt(backend="b2", number=1, t=10.26)
    failed.end(t=10.27, error="upstream_connect_error")
    attempt = span.attempt(backend="b1", number=2, t=10.28)
    headers: dict[str, str] = {}
    attempt.inject(headers)
    span.first_token(t=10.5)
    attempt.end(t=11.5, status=200)
    span.content(input_messages='[{"role": "user"}]', output_messages='[{"role": "assistant"}]')
    span.finish(
        t=11.5, status=200, outcome="completed", input_tokens=12, output_tokens=5, finish_reasons=["stop"],
        ttft_s=0.5, itl=ItlSummary(4, 0.25, 0.2, 0.4, 0.4),
    )  # fmt: skip
    tracing.flush()
    return headers


def by_name(exporter: Collector) -> dict[str, SinkSpan]:
    return {span.name: span for span in exporter.spans()}


def test_a_request_is_a_server_span_with_queue_route_and_attempt_children(exporter: Collector) -> None:
    run_request(traced(exporter))
    spans = by_name(exporter)
    assert set(spans) == {"chat test/chat", "queue", "route", "upstream b1", "upstream b2"}
    server = spans["chat test/chat"]
    assert server.kind == SERVER
    assert server.parent_id == ""
    for name in ("queue", "route", "upstream b1", "upstream b2"):
        assert spans[name].parent_id == server.span_id, name
        assert spans[name].trace_id == server.trace_id, name
    assert spans["upstream b1"].kind == CLIENT
    assert server.start_ns == int((EPOCH + 10.0) * 1e9)
    assert server.end_ns == int((EPOCH + 11.5) * 1e9)
    assert spans["queue"].attributes[t.QUEUE_S] == pytest.approx(0.249)


def test_the_server_span_carries_genai_attributes_and_latency_percentiles(exporter: Collector) -> None:
    run_request(traced(exporter))
    attributes = by_name(exporter)["chat test/chat"].attributes
    assert attributes[t.GEN_AI_OPERATION_NAME] == "chat"
    assert attributes[t.GEN_AI_REQUEST_MODEL] == "test/chat"
    assert attributes[t.GEN_AI_REQUEST_MAX_TOKENS] == 16
    assert attributes[t.GEN_AI_USAGE_INPUT_TOKENS] == 12
    assert attributes[t.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert attributes[t.GEN_AI_RESPONSE_FINISH_REASONS] == ["stop"]
    assert attributes[t.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == 0.5
    assert (attributes[t.ITL_P50_S], attributes[t.ITL_P99_S]) == (0.2, 0.4)
    assert (attributes[t.TENANT], attributes[t.CLASS], attributes[t.BACKEND]) == ("acme", "interactive", "b1")


def test_the_route_span_names_the_backend_and_every_candidates_score(exporter: Collector) -> None:
    run_request(traced(exporter))
    attributes = by_name(exporter)["route"].attributes
    assert attributes[t.ROUTING_REASON] == "prefix_match"
    assert attributes[t.ROUTING_MATCHED_BLOCKS] == 3
    assert attributes[t.ROUTING_CANDIDATES] == ["b1", "b2"]
    assert attributes[t.ROUTING_SCORES] == [0.9, 0.4]


def test_the_first_token_is_an_event_and_a_failed_attempt_is_an_error(exporter: Collector) -> None:
    run_request(traced(exporter))
    spans = by_name(exporter)
    (event,) = spans["chat test/chat"].events
    assert event == (t.FIRST_TOKEN_EVENT, int((EPOCH + 10.5) * 1e9))
    failed = spans["upstream b2"]
    assert failed.status_code == ERROR
    assert failed.attributes[t.ERROR_TYPE] == "upstream_connect_error"
    assert spans["upstream b1"].status_code == 0


def test_a_client_s_traceparent_is_linked_and_the_upstream_traceparent_names_the_attempt(exporter: Collector) -> None:
    headers = run_request(traced(exporter), traceparent=CLIENT_TRACEPARENT)
    server = by_name(exporter)["chat test/chat"]
    attempt = by_name(exporter)["upstream b1"]
    assert server.trace_id != "0af7651916cd43dd8448eb211c80319c", "the gateway's own trace, not the client's"
    assert server.parent_id == ""
    assert server.links == (("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"),)
    assert headers["traceparent"] == f"00-{server.trace_id}-{attempt.span_id}-01"


def test_a_client_s_sampled_flag_does_not_force_tracing(exporter: Collector) -> None:
    headers = run_request(traced(exporter, sampling_ratio=0.0), traceparent=CLIENT_TRACEPARENT)
    assert exporter.spans() == []
    assert int(headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0


@pytest.mark.parametrize(
    ("capture", "recorded"),
    [(False, False), (True, True)],
    ids=["prompt and completion are never recorded by default", "the capture flag opts in to recording them"],
)
def test_content_capture(exporter: Collector, capture: bool, recorded: bool) -> None:
    run_request(traced(exporter, capture_content=capture))
    attributes = by_name(exporter)["chat test/chat"].attributes
    assert (t.GEN_AI_INPUT_MESSAGES in attributes) is recorded
    assert (t.GEN_AI_OUTPUT_MESSAGES in attributes) is recorded


def test_a_zero_sampling_ratio_exports_nothing_but_still_propagates(exporter: Collector) -> None:
    headers = run_request(traced(exporter, sampling_ratio=0.0))
    assert exporter.spans() == []
    flags = int(headers["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # not sampled: the backend should not sample either


def test_disabled_tracing_creates_no_spans_and_shares_one_inert_recorder(exporter: Collector) -> None:
    tracing = Tracing(TracingConfig(enabled=False), epoch_offset=EPOCH, sender=exporter)
    first = tracing.start_request(t=1.0, request_id="a", api=CHAT)
    second = tracing.start_request(t=1.0, request_id="b", api=EMBEDDINGS)
    assert first is second
    assert not first.recording
    assert run_request(tracing) == {}
    assert exporter.bodies == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, TracingConfig(enabled=False, endpoint=None)),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            TracingConfig(enabled=True, sampling_ratio=0.25, endpoint="http://collector:4318/v1/traces"),
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces", "OTEL_SERVICE_NAME": "gw-eu"},
            TracingConfig(enabled=True, endpoint="http://c:4318/v1/traces", service_name="gw-eu"),
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"},
            TracingConfig(enabled=False, endpoint="http://c:4318/v1/traces"),
        ),
    ],
    ids=[
        "no endpoint means no tracing",
        "the generic endpoint gets the traces path and the sampler argument is the ratio",
        "the traces endpoint is used as is with the service name",
        "the SDK switch turns tracing off",
    ],
)
def test_config_from_the_standard_environment(env: dict[str, str], expected: TracingConfig) -> None:
    assert TracingConfig.from_env(env) == expected


def test_an_unreachable_collector_costs_the_traces_never_the_request() -> None:
    dropped: list[int] = []
    config = TracingConfig(enabled=True, endpoint="http://127.0.0.1:1/v1/traces")  # nothing listens there
    tracing = Tracing(config, epoch_offset=EPOCH, on_dropped=dropped.append)
    span = tracing.start_request(t=10.0, request_id="req-1", api=CHAT)
    span.finish(t=10.5, status=200, outcome="completed")
    tracing.shutdown()  # flushes: the POST fails, the spans are counted as dropped
    assert dropped == [1]


def test_the_resource_names_the_service_and_the_sdk(exporter: Collector) -> None:
    run_request(traced(exporter, service_name="gw-eu"))
    resource = resource_of(exporter.bodies[0])
    assert resource["service.name"] == "gw-eu"
    assert resource["telemetry.sdk.language"] == "python"


def test_the_otlp_headers_variable_is_parsed_as_the_spec_says() -> None:
    config = TracingConfig.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_HEADERS": "Api-Key=a%20b, x-tenant=gw"}
    )
    assert config.headers == {"api-key": "a b", "x-tenant": "gw"}


def test_the_fast_path_sets_the_queue_time_without_a_queue_span(exporter: Collector) -> None:
    tracing = traced(exporter)
    span = tracing.start_request(t=10.0, request_id="req-1", api=CHAT)
    span.queue(start=10.0001, end=10.0002, class_name="interactive")
    span.finish(t=10.5, status=200, outcome="completed")
    tracing.flush()
    (server,) = exporter.spans()
    assert server.attributes[t.QUEUE_S] == pytest.approx(0.0001)


def _encoder() -> SpanEncoder:
    return SpanEncoder({"service.name": "gw"}, "gateway", EPOCH, unique_keys=frozenset({t.REQUEST_ID}))


def _one_span(encoder: SpanEncoder, attributes: dict[str, AttributeValue]) -> bytes:
    fields = [encoder.attributes[key][value] for key, value in attributes.items()]
    span = encoder.span((0x0AF7651916CD43DD, 0x8448EB211C80319C), 7, 0, "chat m", SERVER, 1.0, 2.0, fields)
    return encoder.request([span])


@pytest.mark.parametrize(
    "value",
    [
        "x" * 119,  # the inline short path of a unique string, at its bound
        "x" * 120,
        "é" * 5_000,  # a string longer than a one-byte length, and a span longer than 16 KiB
        "",
    ],
    ids=["119 bytes", "120 bytes", "10 kB of two-byte characters", "empty"],
)
def test_a_request_id_of_any_length_decodes_as_sent(value: str) -> None:
    encoder = _encoder()
    body = _one_span(encoder, {t.REQUEST_ID: value, t.TENANT: "acme"})
    [span] = decode(body)
    assert span.attributes == {t.REQUEST_ID: value, t.TENANT: "acme"}
    assert (span.start_ns, span.end_ns) == (int((1.0 + EPOCH) * 1e9), int((2.0 + EPOCH) * 1e9))


def test_an_array_attribute_is_sent_as_the_array_it_holds() -> None:
    encoder = _encoder()
    attributes: dict[str, AttributeValue] = {"gateway.routing.scores": (0.5, 0.25), "reasons": ("stop", "length")}
    [span] = decode(_one_span(encoder, attributes))
    assert span.attributes == {"gateway.routing.scores": [0.5, 0.25], "reasons": ["stop", "length"]}


def test_values_that_never_repeat_are_not_kept_and_the_kept_ones_are_bounded() -> None:
    """Request ids, floats and score arrays would fill the encoder's tables one entry per request."""
    encoder = _encoder()
    for n in range(MAX_VALUES_PER_KEY + 100):
        attributes: dict[str, AttributeValue] = {
            t.REQUEST_ID: f"req-{n}",
            t.QUEUE_S: n / 7,
            t.ROUTING_SCORES: (n / 3, 1.0),
            t.GEN_AI_USAGE_INPUT_TOKENS: n,  # kept while small (< 4096)
            t.TENANT: f"tenant-{n}",  # kept up to the bound
        }
        body = _one_span(encoder, attributes)
    [span] = decode(body)
    assert span.attributes[t.TENANT] == f"tenant-{MAX_VALUES_PER_KEY + 99}"  # still right past the bound
    tables = encoder._tables
    assert len(tables[t.REQUEST_ID]) == len(tables[t.QUEUE_S]) == len(tables[t.ROUTING_SCORES]) == 0
    assert len(tables[t.GEN_AI_USAGE_INPUT_TOKENS]) == 4096
    assert len(tables[t.TENANT]) == MAX_VALUES_PER_KEY


# Wired: behind real servers
# Traces of real requests: a gateway exporting OTLP/HTTP to a real receiver on loopback.
#
# The gateway runs with ``telemetry.tracing`` in its policy; its spans leave through the SDK's
# batch thread as protobuf, like in production, and land in ``loadtests/harness/otlp_sink.py``. The
# fake backend records the ``traceparent`` each upstream request carried.

SECRET_PROMPT = "the launch code is 0000"


@pytest.fixture
def sink() -> Iterator[tuple[OtlpSink, str]]:
    receiver = OtlpSink(keep=True)
    with serve_in_thread(receiver) as url:
        yield receiver, url


def linked_to_client(sink: OtlpSink, count: int) -> dict[str, SinkSpan]:
    """The ``count`` spans of the gateway's trace whose request span links to the client's span."""
    wait_until(
        lambda: any(CLIENT_TRACE_ID in (t for t, _ in s.links) for s in sink.snapshot()),
        what="the gateway's span linked to the client's",
    )
    trace_id = next(s.trace_id for s in sink.snapshot() if CLIENT_TRACE_ID in (t for t, _ in s.links))
    return spans_of(sink, trace_id, count)


def spans_of(sink: OtlpSink, trace_id: str, count: int) -> dict[str, SinkSpan]:
    wait_until(lambda: sum(s.trace_id == trace_id for s in sink.snapshot()) >= count, timeout=10, what="spans")
    return {s.name: s for s in sink.snapshot() if s.trace_id == trace_id}


def test_a_streamed_request_is_one_trace_joined_to_the_client_s_and_passed_on_upstream(
    sink: tuple[OtlpSink, str], backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    receiver, sink_url = sink
    with start_gateway(session_policy(backend_server.url, telemetry=traces_to(sink_url))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ACME, max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model=CHAT_MODEL,
                messages=[{"role": "user", "content": SECRET_PROMPT}],
                max_tokens=8,
                stream=True,
                extra_headers={"traceparent": CLIENT_TRACEPARENT},
            )
        )
        assert chunks
        spans = linked_to_client(receiver, 3)
    server = spans[f"chat {CHAT_MODEL}"]
    trace_id = server.trace_id
    assert server.links == ((CLIENT_TRACE_ID, "b7ad6b7169203331"),), "the client's span is linked, not a parent"
    assert server.parent_id == ""
    assert server.kind == 2  # SPAN_KIND_SERVER
    attempt = next(s for name, s in spans.items() if name.startswith("upstream "))
    route = spans["route"]
    assert attempt.parent_id == route.parent_id == server.span_id
    assert attempt.kind == 3  # SPAN_KIND_CLIENT
    # The backend's own spans would hang under the attempt: its traceparent names it.
    sent = backend.received[-1].headers["traceparent"]
    assert sent.startswith(f"00-{trace_id}-{attempt.span_id}-")
    assert int(sent.rsplit("-", 1)[1], 16) & 0x01, "sampled"
    attributes = server.attributes
    assert attributes["gen_ai.request.model"] == CHAT_MODEL
    assert attributes["gen_ai.operation.name"] == "chat"
    assert (attributes["gateway.api"], attributes["http.route"]) == ("chat", "/v1/chat/completions")
    assert attributes["gen_ai.usage.input_tokens"] == 7
    assert attributes["gen_ai.usage.output_tokens"] == backend.tokens
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gateway.pipeline.outcome"] == "completed"
    assert attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert "gateway.itl.p99_s" in attributes
    assert "first_token" in [name for name, _ in server.events]
    assert route.attributes["gateway.backend"] == attempt.attributes["gateway.backend"]
    assert server.start_ns <= route.start_ns <= attempt.start_ns <= attempt.end_ns <= server.end_ns
    everything = repr([s.attributes for s in receiver.snapshot()])
    assert SECRET_PROMPT not in everything, "no prompt text in traces unless the policy opts in"


def test_a_failed_request_is_a_span_with_its_error(
    sink: tuple[OtlpSink, str], backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    receiver, sink_url = sink
    backend.status = 500
    with start_gateway(session_policy(backend_server.url, telemetry=traces_to(sink_url))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ACME, max_retries=0)
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(
                model=CHAT_MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_headers={"traceparent": CLIENT_TRACEPARENT},
            )
        spans = linked_to_client(receiver, 3)
    server = spans[f"chat {CHAT_MODEL}"]
    assert server.attributes["http.response.status_code"] == 502
    assert server.attributes["error.type"] == "upstream_error"
    attempt = next(s for name, s in spans.items() if name.startswith("upstream "))
    assert attempt.attributes["http.response.status_code"] == 500


def test_sampling_ratio_zero_exports_nothing(
    sink: tuple[OtlpSink, str], backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    receiver, sink_url = sink
    text = session_policy(backend_server.url, telemetry=traces_to(sink_url, sampling_ratio=0.0))
    with start_gateway(text) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ACME, max_retries=0)
        for _ in range(5):
            client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        # Unsampled: the trace still propagates, its sampled flag off so the backend does not sample.
        flags = backend.received[-1].headers["traceparent"].rsplit("-", 1)[1]
        assert int(flags, 16) & 0x01 == 0
    assert receiver.received == 0
