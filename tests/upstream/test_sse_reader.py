"""SSE framing on its own (``gateway/upstream/sse_reader.py``): events whatever the reads' boundaries,
line ends of every kind, keep-alives, the bound on an event, and the end of a body."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstream.sse_reader import SseEventTooLong, SseFields, SseReader, single_data, sse_fields


def read(chunks: list[bytes], reader: SseReader | None = None) -> list[bytes]:
    """Every event of a body read as ``chunks``, its end included."""
    reader = reader or SseReader()
    events = [event for chunk in chunks for event in reader.feed(chunk)]
    return events + reader.end()


def reference(body: bytes) -> list[bytes]:
    """The events of a whole body by the specification, written the obvious way."""
    lines = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [part + b"\n\n" for part in lines.split(b"\n\n")[:-1]]


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cut % (len(body) + 1) for cut in cuts), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(bounds)]


# Bodies made of what matters to framing: line ends of every kind, field starts, a little text.
PIECES = st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b"data: ", b"data:", b": ping", b"event: x", b"{}", b"a"])
BODIES = st.lists(PIECES, max_size=60).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(BODIES, st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_split_of_a_body_gives_the_events_of_the_whole_body(body: bytes, cuts: list[int]) -> None:
    whole = read([body])
    assert read(split(body, cuts)) == whole
    assert whole == reference(body)


@settings(max_examples=200, deadline=None)
@given(BODIES)
def test_a_body_read_byte_by_byte_gives_the_same_events(body: bytes) -> None:
    assert read([body[i : i + 1] for i in range(len(body))]) == reference(body)


@pytest.mark.parametrize(
    ("chunks", "events"),
    [
        pytest.param([b"data: 1\n\ndata: 2\n\n"], [b"data: 1\n\n", b"data: 2\n\n"], id="two events in one read"),
        pytest.param([b"data: 1\n", b"\ndata: 2", b"\n\n"], [b"data: 1\n\n", b"data: 2\n\n"], id="events across reads"),
        pytest.param([b"data: 1\r\n\r\n"], [b"data: 1\n\n"], id="CRLF line ends come out as LF"),
        pytest.param([b"data: 1\r\r"], [b"data: 1\n\n"], id="lone CR line ends come out as LF"),
        pytest.param([b"data: 1\r", b"\n\r\n"], [b"data: 1\n\n"], id="a CRLF cut between two reads is one line end"),
        pytest.param([b"data: 1\r", b"\r"], [b"data: 1\n\n"], id="a CR at the end of a read before another CR"),
        pytest.param(
            [b"data: 1\r", b"data: 2\n\n"], [b"data: 1\ndata: 2\n\n"], id="a CR before other text ends a line"
        ),
        pytest.param([b": ping\r\n\r\ndata: 1\n\n"], [b": ping\n\n", b"data: 1\n\n"], id="a keep-alive is an event"),
        pytest.param(
            [b"data: 1\n\ndata: cut"], [b"data: 1\n\n"], id="an event without its blank line at the end is dropped"
        ),
        pytest.param([b"data: 1\n\ndata: 2\n"], [b"data: 1\n\n"], id="one line end at the end is not a blank line"),
        pytest.param([b"data: 1\n\r"], [b"data: 1\n\n"], id="a last CR at the end of the body is a line end"),
        pytest.param([b"data: 1\r\r", b"\n"], [b"data: 1\n\n"], id="an LF after a CR that ended an event adds nothing"),
    ],
)
def test_framing(chunks: list[bytes], events: list[bytes]) -> None:
    assert read(chunks) == events


def test_an_event_in_one_read_without_a_cr_is_returned_without_a_copy() -> None:
    chunk = b'data: {"choices":[]}\n\n'
    assert SseReader().feed(chunk)[0] is chunk


def test_the_reader_is_empty_after_the_end_of_a_body_and_after_clear() -> None:
    reader = SseReader()
    assert reader.feed(b"data: cut") == []
    assert reader.end() == []
    assert reader.feed(b"data: 2\n\n") == [b"data: 2\n\n"]
    reader.feed(b"data: half")
    reader.clear()
    assert reader.feed(b"data: 3\n\n") == [b"data: 3\n\n"]


def test_an_event_growing_past_the_bound_is_refused_after_the_complete_events_before_it() -> None:
    reader = SseReader(max_event_bytes=16)
    assert reader.feed(b"data: " + b"x" * 10) == []  # 16 bytes waiting: at the bound, not past it
    with pytest.raises(SseEventTooLong) as refused:
        reader.feed(b"\n\ndata: 1\n\ndata: " + b"y" * 11)
    assert refused.value.events == [b"data: " + b"x" * 10 + b"\n\n", b"data: 1\n\n"]
    assert refused.value.limit == 16
    assert reader.feed(b"data: 2\n\n") == [b"data: 2\n\n"]  # the refused event was dropped


def test_the_bound_is_on_what_waits_so_a_complete_event_is_never_refused() -> None:
    long_event = b"data: " + b"x" * 64 + b"\n\n"
    assert SseReader(max_event_bytes=16).feed(long_event) == [long_event]


def test_a_growing_event_is_refused_whatever_the_size_of_the_reads() -> None:
    reader = SseReader(max_event_bytes=100)
    for _ in range(100):
        assert reader.feed(b"x") == []
    with pytest.raises(SseEventTooLong):
        reader.feed(b"x")


@pytest.mark.parametrize(
    ("event", "fields"),
    [
        pytest.param(b"data: {}\n\n", SseFields(b"{}", (), False), id="one data line"),
        pytest.param(b": ping\n\n", SseFields(None, (), True), id="a comment alone is a keep-alive"),
        pytest.param(b": a\n: b\n\n", SseFields(None, (), True), id="several comments are a keep-alive"),
        pytest.param(b": note\ndata: {}\n\n", SseFields(b"{}", (), True), id="a comment beside data is no keep-alive"),
        pytest.param(
            b'data: {"a":\ndata: 1}\n\n', SseFields(b'{"a": 1}', (), False), id="data lines joined by a space"
        ),
        pytest.param(b"data:{}\n\n", SseFields(b"{}", (), False), id="no space after the colon"),
        pytest.param(
            b"event: message\nid: 2\nretry: 10\ndata: {}\n\n",
            SseFields(b"{}", ((b"event", b"message"), (b"id", b"2"), (b"retry", b"10")), False),
            id="other fields in order",
        ),
        pytest.param(b"error: {}\n\n", SseFields(None, ((b"error", b"{}"),), False), id="an engine's own field"),
        pytest.param(b"event: x\n\n", SseFields(None, ((b"event", b"x"),), False), id="no data and no comment"),
    ],
)
def test_fields_of_an_event(event: bytes, fields: SseFields) -> None:
    assert sse_fields(event) == fields
    assert sse_fields(event).keep_alive == (fields.comment and fields.data is None)


def test_the_last_event_field_wins() -> None:
    fields = sse_fields(b"event: a\nevent: b\ndata: {}\n\n")
    assert fields.last(b"event") == b"b"
    assert fields.last(b"id") is None


@pytest.mark.parametrize(
    "event",
    [
        b"data: {}\n\n",
        b"data:[DONE]\n\n",
        b"data: \n\n",
        b": ping\n\n",
        b"data: 1\ndata: 2\n\n",
        b"event: x\ndata: 1\n\n",
    ],
)
def test_the_fast_path_reads_one_data_line_as_the_fields_do_and_nothing_else(event: bytes) -> None:
    one_line = event.count(b"\n") == 2 and event.startswith(b"data:")
    assert single_data(event) == (sse_fields(event).data if one_line else None)
