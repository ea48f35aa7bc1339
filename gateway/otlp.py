"""OTLP/HTTP export of the gateway's spans: protobuf encoded here, posted from one thread.

Why not the OpenTelemetry SDK's span pipeline: measured on this project's 2-core machine, the
SDK's ``Span`` objects, ``BatchSpanProcessor`` and OTLP encoder cost ~236 µs of CPU per request
(a server span, a route span and one upstream attempt), a third of the gateway's whole
per-request CPU, against the observability issue's budget of 10%. Building the official
``opentelemetry-proto`` classes directly still costs ~65 µs. A span needs only five message
types (``Span``, ``KeyValue``, ``AnyValue``, ``Event``, ``Status``:
``opentelemetry/proto/trace/v1/trace.proto`` and ``common/v1/common.proto``), so they are
encoded here with pre-encoded keys and memoised attribute values (~10-20 µs a request). The
tests decode every byte with the official classes (``loadtests/otlp_sink.py``), so a mistake
here fails them. The SDK still provides the resource (``OTEL_RESOURCE_ATTRIBUTES``,
``service.name``, ``telemetry.sdk.*``), the sampler's bound and the W3C propagator.

Export follows the OTLP/HTTP spec: ``POST {endpoint}`` with ``application/x-protobuf``, headers
from the config (``OTEL_EXPORTER_OTLP_HEADERS``). Requests are batched (``batch_size`` or every
``interval_s``); the queue is bounded (``max_queue`` requests): when the collector is slow or down,
the newest traces are dropped and counted, never buffered without bound and never blocking a
request. A failed POST is counted and its batch dropped (tracing is best-effort by design).
"""

from __future__ import annotations

import http.client
import logging
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[float]

SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2
_ID_MASK = (1 << 64) - 1

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack


@dataclass(slots=True)
class SpanRecord:
    """One finished span; times are seconds on the gateway's monotonic clock."""

    name: str
    kind: int
    span_id: int
    parent_id: int
    start: float
    end: float
    attributes: dict[str, AttributeValue]
    events: list[tuple[str, float]] = field(default_factory=list)
    error: bool = False
    links: tuple[tuple[int, int], ...] = ()
    """Other spans this one relates to without being their child: (trace id, span id)."""


@dataclass(slots=True)
class SpanBatch:
    """The spans one request contributes to its trace."""

    trace_id: int
    spans: list[SpanRecord]


_SMALL_VARINTS = [bytes((i,)) for i in range(128)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _any_value(value: AttributeValue) -> bytes:
    """An ``AnyValue`` message (string 1, bool 2, int 3, double 4, array 5)."""
    kind = value.__class__
    if kind is str:
        return _field(b"\x0a", value.encode())  # type: ignore[union-attr]
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + _varint(value & _ID_MASK)  # type: ignore[operator]
    if kind is float:
        return b"\x21" + _pack_double(value)
    items = b"".join(_field(b"\x0a", _any_value(item)) for item in value)  # type: ignore[union-attr]
    return _field(b"\x2a", items)


class SpanEncoder:
    """Encodes ``SpanBatch``s into one ``ExportTraceServiceRequest``.

    Span attributes are encoded as whole tagged fields and memoised where values repeat across
    requests (strings and bools: model, tenant, class, backend, outcome; small ints: status
    codes, token counts); a float reuses its key's pre-encoded prefix.
    """

    def __init__(
        self,
        resource: Mapping[str, AttributeValue],
        scope_name: str,
        epoch_offset: float,
        *,
        unique_keys: frozenset[str] = frozenset(),
    ) -> None:
        """``unique_keys`` hold a new value per request (a request id): never memoised."""
        self._offset = epoch_offset
        self._unique = unique_keys
        self._memo: dict[tuple[str, str | bool | int | tuple[str, ...]], bytes] = {}
        self._double_prefix: dict[str, bytes] = {}
        resource_body = b"".join(_field(b"\x0a", _key_value(k, v)) for k, v in resource.items())
        self._resource = _field(b"\x0a", resource_body)
        self._scope = _field(b"\x0a", _field(b"\x0a", scope_name.encode()))

    def spans(self, trace: SpanBatch) -> bytes:
        """One request's spans as ``ScopeSpans.spans`` fields, ready to be joined into a batch."""
        trace_id = trace.trace_id.to_bytes(16, "big")
        return b"".join([self._span(trace_id, span) for span in trace.spans])

    def request(self, encoded_spans: Iterable[bytes]) -> bytes:
        """The ``ExportTraceServiceRequest`` around spans encoded by ``spans``."""
        scope_spans = _field(b"\x12", self._scope + b"".join(encoded_spans))
        return _field(b"\x0a", self._resource + scope_spans)

    def _ns(self, t: float) -> bytes:
        return _pack_fixed64(int((t + self._offset) * 1e9))

    def _span(self, trace_id: bytes, span: SpanRecord) -> bytes:
        attribute, memo, doubles = self._attribute, self._memo, self._double_prefix
        parts = [
            b"\x0a\x10",
            trace_id,
            b"\x12\x08",
            span.span_id.to_bytes(8, "big"),
            b"\x22\x08" + span.parent_id.to_bytes(8, "big") if span.parent_id else b"",
            _field(b"\x2a", span.name.encode()),
            b"\x30",
            _varint(span.kind),
            b"\x39",
            self._ns(span.start),
            b"\x41",
            self._ns(span.end),
        ]
        append = parts.append
        for key, value in span.attributes.items():
            # The two common cases inline (a memoised pair; a float after its key's prefix), the
            # rest through ``_attribute``: a call per attribute is a third of the encoding time.
            kind = value.__class__
            if kind is float:
                prefix = doubles.get(key)
                if prefix is not None:
                    append(prefix + _pack_double(value))
                    continue
            elif kind is not list:
                cached = memo.get((key, value))  # type: ignore[arg-type]
                if cached is not None:
                    append(cached)
                    continue
            append(attribute(key, value))
        for name, t in span.events:
            parts.append(_field(b"\x5a", b"\x09" + self._ns(t) + _field(b"\x12", name.encode())))
        for linked_trace, linked_span in span.links:  # Span.links (13): Link {trace_id 1, span_id 2}
            link = b"\x0a\x10" + linked_trace.to_bytes(16, "big") + b"\x12\x08" + linked_span.to_bytes(8, "big")
            parts.append(_field(b"\x6a", link))
        if span.error:
            parts.append(b"\x7a\x02\x18\x02")  # status {code: STATUS_CODE_ERROR}
        return _field(b"\x12", b"".join(parts))

    def _attribute(self, key: str, value: AttributeValue) -> bytes:
        """One ``Span.attributes`` field (tag 9), ``KeyValue`` inside."""
        kind = value.__class__
        if kind is float:
            prefix = self._double_prefix.get(key)
            if prefix is None:
                encoded_key = _field(b"\x0a", key.encode())
                prefix = self._double_prefix[key] = (
                    b"\x4a" + _varint(len(encoded_key) + 11) + encoded_key + b"\x12\x09\x21"
                )
            return prefix + _pack_double(value)
        # Strings, bools, small ints and tuples (of strings: candidate backends, finish reasons) repeat.
        repeats = kind is str or kind is bool or kind is tuple or (kind is int and 0 <= value < 4096)  # type: ignore[operator]
        memo = repeats and key not in self._unique
        if memo:
            cached = self._memo.get((key, value))  # type: ignore[arg-type]
            if cached is not None:
                return cached
        encoded = _field(b"\x4a", _key_value(key, value))
        if memo and len(self._memo) < 65_536:
            self._memo[(key, value)] = encoded  # type: ignore[index]
        return encoded


def _key_value(key: str, value: AttributeValue) -> bytes:
    """A ``KeyValue`` message's body."""
    return _field(b"\x0a", key.encode()) + _field(b"\x12", _any_value(value))


Sender = Callable[[bytes], None]


class HttpSender:
    """POSTs OTLP/HTTP protobuf bodies to one endpoint over a kept-alive connection."""

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout_s: float = 10.0) -> None:
        url = urlsplit(endpoint)
        self._https = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._https else 80)
        self._path = url.path or "/v1/traces"
        self._headers = {"content-type": "application/x-protobuf", **headers}
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def __call__(self, body: bytes) -> None:
        for attempt in (1, 2):  # a kept-alive connection the collector closed: reconnect once
            connection = self._connection or self._connect()
            try:
                connection.request("POST", self._path, body=body, headers=self._headers)
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._connection = None
                if attempt == 2:
                    raise
                continue
            if response.status >= 300:
                raise OSError(f"the collector answered {response.status}")
            return

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        self._connection = kind(self._host, self._port, timeout=self._timeout_s)
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()


class BatchExporter:
    """A bounded queue of encoded traces, sent in batches by one daemon thread.

    A trace is encoded when it is submitted, on the caller's thread (the event loop): ~10-20 µs
    spread evenly over requests. Encoding on the export thread instead would hold the GIL for
    milliseconds per batch while the event loop waits for it (latency spikes on every request
    then in flight); the thread only joins bytes and sends them, and a socket releases the GIL
    while it writes and reads.
    """

    def __init__(
        self,
        encoder: SpanEncoder,
        send: Sender,
        *,
        max_queue: int = 4096,
        batch_size: int = 512,
        interval_s: float = 1.0,
        on_dropped: Callable[[int], None] | None = None,
        background: bool = True,
    ) -> None:
        """``background=False`` sends only on ``flush`` (tests)."""
        self._encoder = encoder
        self._send = send
        self._queue: deque[tuple[bytes, int]] = deque()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._interval_s = interval_s
        self._on_dropped = on_dropped
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # one batch in flight at a time (thread, flush, shutdown)
        self.dropped = 0
        self.failed = 0
        self.exported = 0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
            self._thread.start()

    def submit(self, trace: SpanBatch) -> None:
        """Encode and queue one request's spans; dropped (and counted) when the queue is full."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._drop(len(trace.spans))
            return
        queue.append((self._encoder.spans(trace), len(trace.spans)))
        if len(queue) == self._batch_size:
            self._wake.set()

    def flush(self) -> None:
        """Send everything queued now, in the caller's thread."""
        while self._queue:
            self._send_batch()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.flush()
        close = getattr(self._send, "close", None)
        if close is not None:
            close()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while len(self._queue) >= 1 and not self._stopping:
                self._send_batch()
                if len(self._queue) < self._batch_size:
                    break

    def _send_batch(self) -> None:
        with self._lock:
            queue = self._queue
            batch = [queue.popleft() for _ in range(min(len(queue), self._batch_size))]
            if not batch:
                return
            spans = sum(count for _, count in batch)
            try:
                self._send(self._encoder.request([encoded for encoded, _ in batch]))
            except Exception as exc:  # the collector's problem must never become the gateway's
                self.failed += spans
                log.warning("could not export %d spans: %s", spans, exc)
                self._drop(spans)
                return
            self.exported += spans

    def _drop(self, spans: int) -> None:
        self.dropped += spans
        if self._on_dropped is not None:
            self._on_dropped(spans)
