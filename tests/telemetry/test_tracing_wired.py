"""Traces of real requests: a gateway exporting OTLP/HTTP to a real receiver on loopback.

The gateway runs with ``telemetry.tracing`` in its policy; its spans leave through the SDK's
batch thread as protobuf, like in production, and land in ``loadtests/otlp_sink.py``. The
fake backend records the ``traceparent`` each upstream request carried.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from loadtests.otlp_sink import OtlpSink, SinkSpan
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy, traces_to
from tests.servers import serve_in_thread, wait_until

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-b7ad6b7169203331-01"
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
