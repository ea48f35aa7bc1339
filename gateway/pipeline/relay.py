"""Server-sent-event relay: pass chunks through as they arrive, and time the tokens in them.

Every upstream read is split into complete SSE events; the complete ones are forwarded in a
single ``send`` before the next read, so the client sees each chunk before the gateway asks
the backend for the next one (nothing is buffered beyond an incomplete event). Each event's
JSON is parsed once, and read by the request's dialect (``Dialect.read_chunk``,
``gateway/dialects/``) to learn:

* whether it carries generated output (for the OpenAI APIs a content, reasoning or tool-call
  delta, or a completions ``text``): its arrival time feeds TTFT and the inter-token gaps.
  vLLM's first, role-only chunk carries none, so it does not count;
* the usage totals (the gateway always asks for them, ``Dialect.stream_usage_fields``); the
  usage-only chunk (``"choices": []``) is dropped when the client did not ask for it;
* the finish reasons;

and, before the dialect, by the relay itself:

* an upstream error event (``data: {"error": ...}``, or llama.cpp's ``error: {...}`` field):
  it ends this upstream, and the client gets the gateway's own error event in its place
  (``gateway/upstream/errors.py``: gateway code, sanitised message), never the backend's text.

Framing (``SseReader``) follows the SSE specification, not one engine: lines may end in CRLF, LF or CR (the
client always gets LF); the common event, one ``data:`` line, takes the fast path; any other
(comments, ``event``/``id``/``retry`` fields, several ``data:`` lines) is parsed field by field
and relayed as one ``data:`` line, its ``event``/``id``/``retry`` fields dropped (a client
must not reconnect on a backend's say-so). A comment-only event (a keep-alive) becomes the
gateway's own ``: keep-alive`` comment, so the connection stays warm and the backend's text
does not reach the client; it is no output and never starts TTFT. A ``data:`` payload that is
not a JSON object, and anything after ``[DONE]``, is dropped. An event that grows past
``MAX_EVENT_BYTES`` without ending, or output holding a credential of the gateway's, ends the
upstream as a protocol error.

The stream the client sees ends as its API's streams end: ``data: [DONE]`` for the OpenAI
choice-chunk APIs, the final typed event for Responses and Messages. When the upstream fails or
closes early, the API's error event comes first (OpenAI-style ``data: {"error": ...}`` as vLLM
reports a failure, the typed ``error`` event of Responses and Messages).

A translated request (Messages answered through chat completions) is read as the upstream's
API and written as the client's: each upstream event goes through the translation's stream
translator (``gateway/dialects/messages_chat.py``), which may make several events of one.

A broken stream can also be *continued* on another backend (``gateway/pipeline/migration.py``):
the relay then hands every chunk to the request's ``ChunkSplice`` (``migration.StreamSplice``),
which remembers what the client has seen and, after a resume, rewrites the next upstream's
chunks into the same client stream. The relay only forwards: after ``resume`` it reads the next
upstream with fresh framing state, and cuts the per-chunk usage the gateway asked for (to follow
the stream) when the client did not ask for it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from enum import Enum
from typing import Any, Protocol

import orjson
from starlette.types import Send

from gateway.clock import Clock
from gateway.dialects.base import ChunkReading, Dialect, StreamTranslator
from gateway.errors import GatewayError, UpstreamError, UpstreamRejected
from gateway.telemetry.token_stats import TokenStats
from gateway.upstream.errors import ERROR_EVENT_TYPES, Redactor, UpstreamFault, event_error
from gateway.upstream.sse_reader import MAX_EVENT_BYTES, SseEventTooLong, SseReader, sse_fields

DONE_EVENT = b"data: [DONE]\n\n"
KEEP_ALIVE_EVENT = b": keep-alive\n\n"
_NO_REDACTION = Redactor()
_EVENT_NAME = re.compile(rb"[A-Za-z0-9_.]{1,64}")
"""An SSE event name relayed as is: the typed events' names (``response.output_text.delta``,
``content_block_delta``); anything else is not passed on."""


class StreamEnd(Enum):
    """How a relayed stream ended; the label of ``gateway_requests_total{outcome}``."""

    COMPLETED = "completed"
    UPSTREAM_ERROR = "upstream_error"


class TokenTimer:
    """Arrival times of output chunks: TTFT from the request's arrival, then every gap.

    ``on_first`` is told of the first output (the prefill is done) from inside that chunk's parse,
    so it must only take note: ``Dispatcher.first_token`` counts the prefill done at once and hands
    the room to other requests (their routing) on the loop's next turn, after the chunk is handled."""

    __slots__ = ("_on_first", "arrival", "finish_reasons", "first_output", "gaps", "last_output", "usage")

    def __init__(self, arrival: float, on_first: Callable[[], None] | None = None) -> None:
        self._on_first = on_first
        self.arrival = arrival
        self.first_output: float | None = None
        self.last_output = 0.0
        self.gaps: list[float] = []
        self.usage: Mapping[str, Any] | None = None
        self.finish_reasons: list[str] = []

    def on_output(self, t: float) -> None:
        if self.first_output is None:
            self.first_output = t
            if self._on_first is not None:
                self._on_first()
        else:
            self.gaps.append(t - self.last_output)
        self.last_output = t

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.arrival

    def stats(self) -> TokenStats:
        """What was timed, frozen (the request's outcome keeps it)."""
        return TokenStats(self.arrival, self.first_output, self.gaps, self.usage, tuple(self.finish_reasons))


class ChunkSplice(Protocol):
    """Follows a continuable stream for its client and rewrites its chunks after a resume
    (``gateway/pipeline/migration.py``: ``StreamSplice``); the relay only calls it."""

    def take(self, chunk: dict[str, Any], reading: ChunkReading) -> tuple[ChunkReading, bool] | None:
        """Record ``chunk``, rewriting it in place when it must change: the reading to time and
        count, and whether the chunk changed (``migration.Spliced``); None: drop it."""
        ...

    def not_continuable(self) -> None:
        """The upstream failed in a way another engine would repeat (a rejection, a protocol error)."""
        ...


class SseRelay:
    """Relays upstream SSE bodies to one client, feeding a ``TokenTimer``.

    ``run`` relays one upstream and closes the client's stream. A caller that may continue a
    broken stream elsewhere gives a ``splice`` and calls ``forward`` (relay one upstream, return
    its failure), then ``resume`` (and the splice's own) and ``forward`` again with the next
    upstream, and ``finish`` once.
    """

    __slots__ = (
        "_client_done",
        "_clock",
        "_done_marker",
        "_error_event",
        "_failure",
        "_keep_continuous",
        "_named",
        "_on_event",
        "_read",
        "_reader",
        "_redactor",
        "_rename",
        "_report",
        "_send",
        "_splice",
        "_strip_usage",
        "_timer",
        "_translator",
        "dropped_events",
        "saw_done",
        "saw_error",
    )

    def __init__(
        self,
        send: Send,
        timer: TokenTimer,
        clock: Clock,
        *,
        dialect: Dialect,
        strip_usage: bool,
        splice: ChunkSplice | None = None,
        keep_continuous: bool = True,
        redactor: Redactor = _NO_REDACTION,
        rename: tuple[tuple[bytes, bytes], ...] = (),
        on_event: Callable[[dict[str, Any]], None] | None = None,
        client: Dialect | None = None,
        translator: StreamTranslator | None = None,
    ) -> None:
        """``dialect`` reads the events (the API the backend answers); ``client`` is the client's API
        when it is another (a translated request): its error events and end, and ``translator``
        turns each upstream event into its events; ``splice`` follows a continuable stream; ``keep_continuous=False``
        removes per-chunk usage; ``rename`` (from ``renaming``) gives the events the model name the
        client called instead of the engine's; ``on_event`` sees every relayed event's JSON (a
        shadow's quality scorer collects the primary's text through it).

        ``redactor`` (``UpstreamClient.redactor``) sanitises upstream error events and knows the
        credentials no relayed byte may hold.
        """
        self._send = send
        self._timer = timer
        self._clock = clock
        self._read = dialect.read_chunk
        self._named = dialect.sse_event_names
        self._error_event = (client or dialect).error_event
        self._done_marker = dialect.ends_with_done
        self._client_done = (client or dialect).ends_with_done
        self._translator = translator
        self._strip_usage = strip_usage
        self._keep_continuous = keep_continuous
        self._reader = SseReader(max_event_bytes=MAX_EVENT_BYTES)
        self._splice = splice
        self._redactor = redactor
        self._rename = rename
        self._on_event = on_event
        self._report: Callable[[UpstreamFault], None] | None = None
        self._failure: GatewayError | None = None
        self.saw_done = False
        self.saw_error = False
        self.dropped_events = 0

    async def run(
        self, chunks: AsyncIterator[bytes], report: Callable[[UpstreamFault], None] | None = None
    ) -> StreamEnd:
        """Relay until the upstream ends; then close the client's stream properly."""
        return await self.finish(await self.forward(chunks, report))

    async def forward(
        self, chunks: AsyncIterator[bytes], report: Callable[[UpstreamFault], None] | None = None
    ) -> GatewayError | None:
        """Relay one upstream body; return why it ended early, or None when it finished.

        An upstream error event ends it (the rest of the body is not read): its fault goes to
        ``report`` (``upstream_errors.FaultLog``), the gateway's error is returned.
        """
        self._report = report
        send, take = self._send, self._take
        try:
            async for chunk in chunks:
                # _relay_end's body written out: no coroutine per relayed chunk
                if out := take(chunk):
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if self._failure is not None:
                    return self._take_failure()
            # The body ended: a last CR is a line end, not half a CRLF (``SseReader.end``).
            if (failure := await self._relay_end()) is not None:
                return failure
        except GatewayError as exc:
            return exc
        finally:
            if isinstance(chunks, AsyncGenerator):
                await chunks.aclose()  # now, not at garbage collection: it may hold a timeout
        if not self.saw_done and not self.saw_error and (self._done_marker or not self._timer.finish_reasons):
            return UpstreamError("The backend closed the stream before it finished.", code="upstream_protocol_error")
        return None

    async def _relay_end(self) -> GatewayError | None:
        """Send the events the body's end completes; the failure they end with, if any."""
        if out := self._take(b"", end=True):
            await self._send({"type": "http.response.body", "body": out, "more_body": True})
        return self._take_failure()

    def _take(self, chunk: bytes, end: bool = False) -> bytes:
        """The complete events ``chunk`` (or the body's ``end``) completes, ready to send (nothing if
        they hold a credential)."""
        out = self._feed(chunk, self._clock.now(), end)
        if out and self._redactor.leaks(out):
            self._fail_protocol("the stream holds a credential of the gateway")
            return b""
        if self._rename:
            for served, public in self._rename:
                out = out.replace(served, public)
        return out

    def rename_also(self, old: bytes, new: bytes) -> None:
        """Replace ``old`` by ``new`` in every byte relayed from now on, the events being relayed
        included (``on_event`` runs before they are sent): a stored answer's id, by its sealed one.
        ``old`` is a whole JSON string (quotes included), which only a JSON value can be."""
        self._rename = (*self._rename, (old, new))

    def _take_failure(self) -> GatewayError | None:
        failure, self._failure = self._failure, None
        return failure

    def resume(self) -> None:
        """The next ``forward`` reads another upstream that continues the stream (the splice
        rewrites its chunks): fresh framing, no failure yet."""
        self._reader.clear()
        self._failure = None
        self.saw_done = self.saw_error = False

    async def finish(self, failure: GatewayError | None) -> StreamEnd:
        """Close the client's stream: its API's end (``[DONE]`` for the OpenAI choice-chunk APIs, a
        translation's closing events), after an error event when ``failure``."""
        done = DONE_EVENT if self._client_done else b""
        if failure is not None:
            tail = self._error_event(failure) + done
        elif self._translator is not None:
            tail = self._translator.end()
        else:
            tail = done
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})
        if failure is not None or self.saw_error:
            return StreamEnd.UPSTREAM_ERROR
        return StreamEnd.COMPLETED

    def _feed(self, chunk: bytes, t: float, end: bool) -> bytes:
        """What to send of the events ``chunk`` (or the body's ``end``) completes, up to a failure."""
        too_long: SseEventTooLong | None = None
        try:
            events = self._reader.end() if end else self._reader.feed(chunk)
        except SseEventTooLong as exc:  # the complete events before it are relayed first
            events, too_long = exc.events, exc
        kept: list[bytes] = []
        for event in events:
            if self._failure is not None:
                break
            kept_as = self._keep(event, t)
            if kept_as is True:
                kept.append(event)
            elif kept_as:
                kept.append(kept_as)
        if self._failure is not None:
            self._reader.clear()
        elif too_long is not None:
            self._fail_protocol(str(too_long))
        return b"".join(kept)

    def _keep(self, event: bytes, t: float) -> bytes | bool:
        """Whether to forward ``event`` (True), drop it (False), or what to send instead."""
        if self.saw_done:
            return False  # nothing after [DONE]
        # The common case, one data line: ``single_data`` written out (no call per relayed event).
        if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2:
            return self._keep_data(event, event[5:].strip(), t)
        return self._keep_framed(event, t)

    def _keep_framed(self, event: bytes, t: float) -> bytes | bool:
        """Any other event, field by field (module docstring): data relayed, the rest not."""
        fields = sse_fields(event)
        # llama.cpp writes its stream errors as an ``error:`` field
        if error := [value for name, value in fields.others if name == b"error"]:
            return self._upstream_error(_json_or_text(b"\n".join(error)))
        if fields.data is None:
            return KEEP_ALIVE_EVENT if fields.keep_alive else False
        payload = fields.data  # JSON, so the line breaks between its lines were whitespace
        canonical = b"data: " + payload + b"\n\n"
        kind = fields.last(b"event") if self._named else None
        if kind and _EVENT_NAME.fullmatch(kind):  # a name clients dispatch on (Responses, Messages)
            canonical = b"event: " + kind + b"\n" + canonical
        kept = self._keep_data(canonical, payload, t)
        return canonical if kept is True else kept

    def _keep_data(self, event: bytes, payload: bytes, t: float) -> bytes | bool:
        if payload == b"[DONE]":
            self.saw_done = True
            return False  # the relay writes its own [DONE] last
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            document = None
        if not isinstance(document, dict):
            self.dropped_events += 1  # not an OpenAI chunk: no backend text reaches the client
            return False
        if document.get("error") or document.get("object") == "error" or document.get("type") in ERROR_EVENT_TYPES:
            return self._upstream_error(document)
        reading = self._read(document)
        if self._on_event is not None:
            self._on_event(document)
        if self._translator is not None:
            self._observe(reading, t)
            return self._translator.event(document) or False
        if self._splice is None:
            return self._observe(reading, t)
        return self._spliced(event, document, reading, t)

    def _upstream_error(self, document: Any) -> bool:
        """End this upstream with the gateway's error in place of the backend's error event."""
        error, fault = event_error(document, self._redactor)
        self.saw_error = True
        self._failure = error
        if isinstance(error, UpstreamRejected) and self._splice is not None:
            self._splice.not_continuable()  # another engine would reject it too
        if self._report is not None:
            self._report(fault)
        return False

    def _fail_protocol(self, what: str) -> None:
        self.saw_error = True
        self._failure = UpstreamError(
            "The backend sent a stream the gateway cannot use.", code="upstream_protocol_error"
        )
        if self._splice is not None:
            self._splice.not_continuable()
        if self._report is not None:
            self._report(UpstreamFault(200, what, "event"))

    def _spliced(self, event: bytes, chunk: dict[str, Any], reading: ChunkReading, t: float) -> bytes | bool:
        """A chunk of a tracked stream: through the splice, then timed; its per-chunk usage (asked
        for by the gateway to follow the stream) cut when the client did not ask for it."""
        assert self._splice is not None
        spliced = self._splice.take(chunk, reading)
        if spliced is None:
            return False
        reading, rewrite = spliced
        hide_usage = bool(reading[1]) and bool(chunk.get("choices")) and not self._keep_continuous
        if not self._observe(reading, t):
            return False
        if hide_usage and not rewrite:
            cut = _without_trailing_usage(event, null=not self._strip_usage)
            if cut is not None:
                return cut  # the common case: no re-serialisation of every token's chunk
        if hide_usage:
            if self._strip_usage:
                del chunk["usage"]
            else:
                chunk["usage"] = None  # what the client gets without continuous stats
            rewrite = True
        return b"data: " + orjson.dumps(chunk) + b"\n\n" if rewrite else True

    def _observe(self, reading: ChunkReading, t: float) -> bool:
        """Time and count what ``reading`` says; False when the event is to be dropped (a
        usage-only chunk nobody asked for)."""
        output, usage, reasons, usage_only = reading
        timer = self._timer
        if usage:
            if usage.get("prompt_tokens") is None and timer.usage:  # Messages: the prompt came first
                usage = {**usage, "prompt_tokens": timer.usage.get("prompt_tokens")}
            timer.usage = usage
        if usage_only:
            return not self._strip_usage
        if reasons:
            timer.finish_reasons.extend(reasons)
        if output:
            timer.on_output(t)
        return True


def renaming(served: object, public: str) -> tuple[tuple[bytes, bytes], ...]:
    """Byte replacements that turn the engine's ``"model":"<served>"`` into the public name.

    Safe on the raw events: in JSON, an unescaped ``"model":"x"`` occurs only as a key and its
    value (inside a string every quote is escaped), and in a chunk the only ``model`` key is the
    top-level one. Both spacings engines write (compact, and ``": "``) are covered."""
    if not isinstance(served, str) or served == public:
        return ()
    old, new = orjson.dumps(served), orjson.dumps(public)
    return ((b'"model":' + old, b'"model":' + new), (b'"model": ' + old, b'"model": ' + new))


def _json_or_text(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return {"error": {"message": payload.decode(errors="replace")}}


def _without_trailing_usage(event: bytes, *, null: bool) -> bytes | None:
    """``event`` without the per-chunk usage the gateway asked for, cut out of the bytes.

    vLLM serialises a chunk compactly with ``usage`` as its last field and a flat object
    (``{"prompt_tokens":..,"total_tokens":..,"completion_tokens":..}``); then the field is
    removed (or set to ``null``, what the client gets without continuous stats) without
    parsing and re-serialising the chunk. Anything else returns None (the caller re-serialises);
    the pattern cannot occur inside a JSON string, where quotes are escaped.
    """
    start = event.rfind(b',"usage":{')
    if start < 0:
        return None
    end = event.find(b"}", start)
    if end < 0 or event[end + 1 :] != b"}\n\n":
        return None
    return event[:start] + (b',"usage":null' if null else b"") + event[end + 1 :]
