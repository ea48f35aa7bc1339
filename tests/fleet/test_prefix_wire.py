"""The prefix view's stream entries: what one process writes, another reads back exactly."""

from __future__ import annotations

import orjson
import pytest

from gateway.fleet.prefix_wire import BLOCKS, HEADER, Decision, MalformedEntry, decode, encode, origin_of


def test_a_batch_reads_back_as_written_with_full_64_bit_hashes() -> None:
    batch = [
        Decision("m", "b0", (0, 1, 2**64 - 1)),
        Decision("m", "b1", ()),
        Decision("other", "b0", tuple(range(2**63, 2**63 + 100))),
    ]
    fields = encode("replica-1", batch)
    assert origin_of(fields) == "replica-1"
    assert [(d.model, d.backend, tuple(d.blocks)) for d in decode(fields)] == [
        (d.model, d.backend, tuple(d.blocks)) for d in batch
    ]
    assert len(fields[BLOCKS]) == 8 * 103, "eight bytes a block"


def test_no_text_travels_only_names_and_hashes() -> None:
    fields = encode("r", [Decision("m", "b0", (7, 8))])
    assert orjson.loads(fields[HEADER]) == [["m", "b0", 2]]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {HEADER: b"not json", BLOCKS: b""},
        {HEADER: b"{}", BLOCKS: b""},
        {HEADER: b'[["m", "b", 2]]', BLOCKS: b"\x00" * 8},
        {HEADER: b'[["m", "b", 1]]', BLOCKS: b"\x00" * 12},
        {HEADER: b'[["m", "b", -1]]', BLOCKS: b""},
        {HEADER: b'[["m", 3, 0]]', BLOCKS: b""},
        {HEADER: b'[["m", "b", 0]]', BLOCKS: b"\x00" * 8},
    ],
)
def test_an_entry_whose_parts_disagree_is_refused(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedEntry):
        decode(fields)
