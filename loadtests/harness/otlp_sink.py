"""A minimal OTLP/HTTP trace receiver: what a collector does with the gateway's spans, minus storage.

Why: the tracing tests and the telemetry-overhead benchmark need the gateway to export its
spans for real (protobuf over HTTP to another endpoint, from the SDK's batch thread), not into
an in-process list, so that what is measured and checked is what production does. The sink
accepts ``POST /v1/traces`` (``ExportTraceServiceRequest``, protobuf), answers 200, and keeps
the decoded spans (``keep=True``, tests) or only counts them (the benchmark).

Usage::

    sink = OtlpSink(keep=True)
    with serve_in_thread(sink, port) as url:     # tests/servers.py
        ... gateway with telemetry.tracing.endpoint = url + "/v1/traces" ...
        sink.spans   # [SinkSpan(name=..., trace_id=..., span_id=..., parent_id=..., attributes={...})]

    python -m loadtests.harness.otlp_sink --port 4318    # a process of its own, counting
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

Scope = dict[str, Any]


@dataclass(frozen=True)
class SinkSpan:
    """One received span, with ids as hex (as in ``traceparent``) and attributes as Python values."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, int], ...] = ()  # (name, time in ns)
    status_code: int = 0  # 2: error
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) as hex


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


class OtlpSink:
    """An ASGI app receiving OTLP/HTTP protobuf traces; thread-safe readers."""

    def __init__(self, *, keep: bool = False) -> None:
        self.keep = keep
        self.spans: list[SinkSpan] = []
        self.received = 0
        self._lock = threading.Lock()
        self._ok = ExportTraceServiceResponse().SerializeToString()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, answer = 404, b""
        if scope["method"] == "POST" and scope["path"] == "/v1/traces":
            status, answer = 200, self._ok
            self._take(body)
        elif scope["path"] == "/count":  # spans received so far, as text (readiness and benchmarks)
            status, answer = 200, str(self.received).encode()
        headers = [(b"content-type", b"application/x-protobuf")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    def _take(self, body: bytes) -> None:
        spans = decode(body) if self.keep else []
        count = len(spans) if self.keep else _count(body)
        with self._lock:
            self.received += count
            self.spans.extend(spans)

    def snapshot(self) -> list[SinkSpan]:
        with self._lock:
            return list(self.spans)


def _parse(body: bytes) -> list[Any]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def _count(body: bytes) -> int:
    return len(_parse(body))


def resource_of(body: bytes) -> dict[str, Any]:
    """The resource attributes of the first ``ResourceSpans`` of an export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return {a.key: _value(a.value) for a in request.resource_spans[0].resource.attributes}


def decode(body: bytes) -> list[SinkSpan]:
    """Every span of an ``ExportTraceServiceRequest`` (protobuf bytes), decoded."""
    return [
        SinkSpan(
            name=span.name,
            kind=span.kind,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_id=span.parent_span_id.hex(),
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
            attributes={a.key: _value(a.value) for a in span.attributes},
            events=tuple((e.name, e.time_unix_nano) for e in span.events),
            status_code=span.status.code,
            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
        )
        for span in _parse(body)
    ]


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    uvicorn.run(OtlpSink(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
