"""Server-sent-event framing of an engine's streamed answer: bytes in, whole events out.

An engine streams its answer as SSE (the specification's "event stream" format); the relay
(``gateway/pipeline/relay.py``) and the shadow runner (``gateway/shadow/runner.py``) both read
it, so the framing lives here once:

* events end at a blank line; a read may end anywhere, even between the CR and LF of a line
  end, and the rest waits for the next read (``SseReader.feed``);
* lines may end in CRLF, LF or lone CR; every event comes out with LF only, the common body
  without a CR taking the fast path (no copy);
* an event that grows past ``MAX_EVENT_BYTES`` without ending is refused (``SseEventTooLong``)
  instead of a buffer that grows without bound;
* when the body ends (``SseReader.end``), a last CR is a line end, not half a CRLF; an event
  without its blank line is dropped, since an engine that cut its stream mid-event did not
  send it;
* an event's fields (``sse_fields``): its ``data`` lines joined, the other fields, and whether a
  comment line was in it, so that a comment-only event (a keep-alive) is told apart.

It knows nothing of what the events mean (OpenAI chunks, ``[DONE]``, error events): the callers
do. It lives in the upstream stage, not the pipeline, because it is the engines' wire format: the
lowest stage both readers import, beside the client that hands over the body's reads.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_EVENT_BYTES = 4 << 20  # one event of n choices with top logprobs stays far below
_CR = ord("\r")


class SseEventTooLong(Exception):
    """The incomplete event in hand grew past the reader's bound; the reader dropped it.

    ``events`` are the complete events the same read gave before it, in order: a caller that
    forwards events as they come forwards those, then ends the stream."""

    def __init__(self, events: list[bytes], limit: int) -> None:
        super().__init__(f"an event longer than {limit} bytes")
        self.events = events
        self.limit = limit


class SseReader:
    """Splits one upstream body, read by read, into SSE events (module docstring).

    Each event is returned whole, its lines ending in LF and its blank line included
    (``b"data: {...}\\n\\n"``), as soon as the read that completes it is fed; nothing is held back
    but the incomplete rest. Usage::

        reader = SseReader()
        async for chunk in body:
            for event in reader.feed(chunk):   # raises SseEventTooLong
                ...
        for event in reader.end():
            ...
    """

    __slots__ = ("_limit", "_rest")

    def __init__(self, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._limit = max_event_bytes
        self._rest = b""

    def __repr__(self) -> str:
        return f"SseReader(max_event_bytes={self._limit})"

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, in order; the rest is kept for the next read."""
        rest = self._rest
        if rest:
            data = rest + chunk
            if b"\r" in chunk or rest[-1] == _CR:  # the rest has no other CR: it was normalised
                data = _lf_only(data)
            # The rest held no blank line: search from its last two bytes (a CR may have become an LF).
            end = data.find(b"\n\n", len(rest) - 2 if len(rest) > 2 else 0)
        else:
            data = _lf_only(chunk) if b"\r" in chunk else chunk
            end = data.find(b"\n\n")
            if end >= 0 and end + 2 == len(data):
                return [data]  # the common case: a read of one whole event, passed on as it came
        events: list[bytes] = []
        start = 0
        while end >= 0:
            events.append(data[start : end + 2])
            start = end + 2
            end = data.find(b"\n\n", start)
        self._rest = rest = data[start:]
        if len(rest) > self._limit:
            self._rest = b""
            raise SseEventTooLong(events, self._limit)
        return events

    def end(self) -> list[bytes]:
        """The body ended: the events a last CR completes (it is a line end); the reader is empty
        again, an event without its blank line dropped."""
        rest, self._rest = self._rest, b""
        if not rest.endswith(b"\r"):
            return []
        data = rest[:-1] + b"\n"  # the rest before the CR held no blank line: one event at most
        return [data] if data.endswith(b"\n\n") else []

    def clear(self) -> None:
        """Drop the incomplete rest: the caller stops reading this body (or starts another)."""
        self._rest = b""


@dataclass(frozen=True, slots=True)
class SseFields:
    """One event's lines by the SSE specification (names and values as sent)."""

    data: bytes | None
    """The ``data`` lines' values joined by a space and stripped (for JSON, the line breaks
    between them were whitespace); None when the event has no ``data`` line."""
    others: tuple[tuple[bytes, bytes], ...]
    """Every other field, ``(name, value)`` in order: ``event``, ``id``, ``retry``, or an
    engine's own (llama.cpp's ``error``)."""
    comment: bool
    """Whether a comment line (``: ...``) was in it."""

    @property
    def keep_alive(self) -> bool:
        """A comment and no data: nothing to dispatch, only there to keep the connection warm."""
        return self.comment and self.data is None

    def last(self, name: bytes) -> bytes | None:
        """The value of the last ``name`` field (the specification's rule for ``event``)."""
        found = None
        for field, value in self.others:
            if field == name:
                found = value
        return found


def single_data(event: bytes) -> bytes | None:
    """The payload of an event that is one ``data:`` line (the common case, read without
    ``sse_fields``), stripped; None for any other event."""
    if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2:
        return event[5:].strip()
    return None


def sse_fields(event: bytes) -> SseFields:
    """The fields of one event as ``SseReader`` returns it (LF line ends)."""
    data: list[bytes] = []
    others: list[tuple[bytes, bytes]] = []
    comment = False
    for line in event.split(b"\n"):
        if not line:
            continue
        if line.startswith(b":"):
            comment = True
            continue
        name, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if name == b"data":
            data.append(value)
        else:
            others.append((name, value))
    return SseFields(b" ".join(data).strip() if data else None, tuple(others), comment)


def _lf_only(data: bytes) -> bytes:
    """CRLF and lone CR line ends as LF; a final CR stays (its LF may start the next read)."""
    tail = data.endswith(b"\r")
    body = data[:-1] if tail else data
    body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return body + b"\r" if tail else body
