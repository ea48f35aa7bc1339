"""OTLP/HTTP export of the gateway's spans: protobuf encoded here, posted from one thread.

Why not the OpenTelemetry SDK's span pipeline: measured on this project's 2-core machine, the
SDK's ``Span`` objects, ``BatchSpanProcessor`` and OTLP encoder cost ~236 µs of CPU per request
(a server span, a route span and one upstream attempt), a third of the gateway's whole
per-request CPU, against the observability issue's budget of 10%. Building the official
``opentelemetry-proto`` classes directly still costs ~65 µs. A span needs only five message
types (``Span``, ``KeyValue``, ``AnyValue``, ``Event``, ``Status``:
``opentelemetry/proto/trace/v1/trace.proto`` and ``common/v1/common.proto``), so they are
encoded here, as the request goes (``gateway/telemetry/tracing.py``): each attribute is one lookup in its
key's table of encoded fields when it is recorded, each span's ids and times one ``struct`` call
when it ends; nothing is built twice. The tests decode every byte with the official classes
(``loadtests/harness/otlp_sink.py``), so a mistake here fails them. The SDK still provides the resource
(``OTEL_RESOURCE_ATTRIBUTES``, ``service.name``, ``telemetry.sdk.*``), the sampler's bound and
the W3C propagator.

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
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

AttributeValue = str | bool | int | float | tuple[str, ...] | tuple[float, ...]  # hashable: the tables' keys

SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2
_ID_MASK = (1 << 64) - 1

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
# Span.trace_id (1) and span_id (2), and parent_span_id (4) when it has one: ids are big-endian bytes.
_pack_ids = struct.Struct(">2sQQ2sQ").pack
_pack_ids_parent = struct.Struct(">2sQQ2sQ2sQ").pack
# Span.start_time_unix_nano (7) and end_time_unix_nano (8): fixed64, little-endian, after their tags.
_pack_times = struct.Struct("<BQBQ").pack


_SMALL_VARINTS = [bytes((i,)) for i in range(128)]
MAX_KEYS = 4096  # attribute keys and span names kept encoded (a gateway has a few dozen)
MAX_VALUES_PER_KEY = 4096  # encoded values kept per key (models, tenants, backends, token counts)
_DOUBLE_ITEM = b"\x0a\x09\x21"  # ArrayValue.values (1): AnyValue {double_value (4), fixed64}
_SPAN_TAGS = [b"\x12" + bytes((i,)) for i in range(128)]


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


class _KeyValues(dict[AttributeValue, bytes]):
    """One attribute key's encoded ``Span.attributes`` fields, by value: a hit is one C lookup.

    ``__missing__`` encodes a value seen for the first time and keeps it where values of this
    key repeat (strings, bools, small ints, tuples: model, tenant, class, backend, outcome,
    status codes, token counts, finish reasons), at most ``MAX_VALUES_PER_KEY`` of them; floats
    and the values of ``unique`` keys (a request's ids) are encoded and never kept. A key's
    values have one type (the semantic conventions give each attribute one), so ``1`` and
    ``True`` or ``1.0`` never meet in one table.
    """

    __slots__ = ("_double_prefix", "_key", "_unique")

    def __init__(self, key: str, unique: bool) -> None:
        super().__init__()
        self._key = _field(b"\x0a", key.encode())  # KeyValue.key (1)
        self._unique = unique
        self._double_prefix = b"\x4a" + _varint(len(self._key) + 11) + self._key + b"\x12\x09\x21"

    def __missing__(self, value: AttributeValue) -> bytes:
        kind = value.__class__
        if kind is float:
            return self._double_prefix + _pack_double(value)
        if kind is str:
            raw = value.encode()  # type: ignore[union-attr]
            size = len(raw)
            if size < 120 and self._unique:  # a request's id: new every time, so the short path inline
                key_value = self._key + b"\x12" + _SMALL_VARINTS[size + 2] + b"\x0a" + _SMALL_VARINTS[size] + raw
                return b"\x4a" + _varint(len(key_value)) + key_value
            encoded = self._field(b"\x0a" + _varint(size) + raw)
        elif kind is tuple and value and value[0].__class__ is float:  # type: ignore[index]
            # doubles (the candidates' routing scores): they never repeat
            items = b"".join([_DOUBLE_ITEM + _pack_double(item) for item in value])  # type: ignore[union-attr]
            return self._field(b"\x2a" + _varint(len(items)) + items)
        else:
            encoded = self._field(_any_value(value))
        repeats = kind is str or kind is bool or kind is tuple or (kind is int and 0 <= value < 4096)  # type: ignore[operator]
        if repeats and not self._unique and len(self) < MAX_VALUES_PER_KEY:
            self[value] = encoded
        return encoded

    def _field(self, any_value: bytes) -> bytes:
        """The whole ``Span.attributes`` field (9) around an encoded ``AnyValue``."""
        key_value = self._key + b"\x12" + _varint(len(any_value)) + any_value
        return b"\x4a" + _varint(len(key_value)) + key_value


class _AttributeTables(dict[str, _KeyValues]):
    """Every attribute key's ``_KeyValues``, made on first use."""

    __slots__ = ("_unique",)

    def __init__(self, unique: frozenset[str]) -> None:
        super().__init__()
        self._unique = unique

    def __missing__(self, key: str) -> _KeyValues:
        table = _KeyValues(key, key in self._unique)
        if len(self) < MAX_KEYS:
            self[key] = table
        return table


class SpanEncoder:
    """Encodes ``SpanBatch``s into one ``ExportTraceServiceRequest``.

    Each attribute is looked up in its key's table of encoded fields (``_KeyValues``): values
    that repeat across requests are encoded once; the others (floats, ids) on the spot. Span
    names with their kind, and every span's fixed-size fields, take one lookup or one
    ``struct`` call each.
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
        self._tables = _AttributeTables(unique_keys)
        self._heads: dict[tuple[str, int], bytes] = {}
        resource_body = b"".join(_field(b"\x0a", _key_value(k, v)) for k, v in resource.items())
        self._resource = _field(b"\x0a", resource_body)
        self._scope = _field(b"\x0a", _field(b"\x0a", scope_name.encode()))

    @property
    def attributes(self) -> _AttributeTables:
        """``attributes[key][value]``: the whole encoded ``Span.attributes`` field of that pair."""
        return self._tables

    def span(
        self,
        trace_id: tuple[int, int],
        span_id: int,
        parent_id: int,
        name: str,
        kind: int,
        start: float,
        end: float,
        attributes: list[bytes],
        events: Sequence[tuple[str, float]] = (),
        links: Sequence[tuple[int, int]] = (),
        error: bool = False,
    ) -> bytes:
        """One span as a ``ScopeSpans.spans`` field, ready to be joined into a batch.

        ``trace_id`` is its high and low 64 bits; ``attributes`` holds fields from
        ``attributes[key][value]``; times are seconds on the gateway's monotonic clock; ``links``
        are other spans (trace id, span id) this one relates to without being their child.
        """
        offset = self._offset
        high, low = trace_id
        ids = (
            _pack_ids_parent(b"\x0a\x10", high, low, b"\x12\x08", span_id, b"\x22\x08", parent_id)
            if parent_id
            else _pack_ids(b"\x0a\x10", high, low, b"\x12\x08", span_id)
        )
        head = self._heads.get((name, kind))
        if head is None:
            head = self._head(name, kind)
        parts = [
            ids,
            head,
            _pack_times(0x39, int((start + offset) * 1e9), 0x41, int((end + offset) * 1e9)),
            *attributes,
        ]
        if events or links or error:
            parts += self._rare_fields(events, links, error)
        body = b"".join(parts)
        size = len(body)
        if size < 0x4000:  # a span is a few hundred bytes: its length is a two-byte varint, inline
            return (b"\x12" + bytes(((size & 0x7F) | 0x80, size >> 7)) if size >= 0x80 else _SPAN_TAGS[size]) + body
        return _field(b"\x12", body)

    def request(self, encoded_spans: Iterable[bytes]) -> bytes:
        """The ``ExportTraceServiceRequest`` around spans encoded by ``span``."""
        scope_spans = _field(b"\x12", self._scope + b"".join(encoded_spans))
        return _field(b"\x0a", self._resource + scope_spans)

    def _ns(self, t: float) -> bytes:
        return _pack_fixed64(int((t + self._offset) * 1e9))

    def _rare_fields(
        self, events: Sequence[tuple[str, float]], links: Sequence[tuple[int, int]], error: bool
    ) -> list[bytes]:
        """Events (11), links (13) and an error status (15): on some spans only."""
        parts = [_field(b"\x5a", b"\x09" + self._ns(t) + _field(b"\x12", name.encode())) for name, t in events]
        for linked_trace, linked_span in links:  # Link {trace_id 1, span_id 2}
            link = b"\x0a\x10" + linked_trace.to_bytes(16, "big") + b"\x12\x08" + linked_span.to_bytes(8, "big")
            parts.append(_field(b"\x6a", link))
        if error:
            parts.append(b"\x7a\x02\x18\x02")  # status {code: STATUS_CODE_ERROR}
        return parts

    def _head(self, name: str, kind: int) -> bytes:
        """``Span.name`` (5) and ``Span.kind`` (6): names repeat (operation and model, backend)."""
        head = _field(b"\x2a", name.encode()) + b"\x30" + _varint(kind)
        if len(self._heads) < MAX_KEYS:
            self._heads[(name, kind)] = head
        return head


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

    A trace is encoded as its request goes, on the event loop (``gateway/telemetry/tracing.py``), a few µs
    at a time. Encoding on the export thread instead would hold the GIL for
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

    def submit(self, encoded: bytes, spans: int) -> None:
        """Queue one request's encoded spans (``spans`` of them); dropped and counted when full."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self._drop(spans)
            return
        queue.append((encoded, spans))
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
