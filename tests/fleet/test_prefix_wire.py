"""The prefix view's stream entries: what one process writes, another with its secret reads back exactly."""

from __future__ import annotations

from array import array

import orjson
import pytest

from gateway.fleet.prefix_wire import (
    BLOCKS,
    CORRECTIONS,
    HEADER,
    Correction,
    Decision,
    MalformedEntry,
    decode,
    decode_corrections,
    encode,
    origin_of,
)
from gateway.routing.prefix_secret import CHECK_BYTES, NONCE_BYTES, PrefixSecret

SECRET = PrefixSecret(b"wire-test-secret")
SEAL = NONCE_BYTES + CHECK_BYTES


def test_a_batch_reads_back_as_written_with_full_64_bit_hashes() -> None:
    batch = [
        Decision("m", "b0", (0, 1, 2**64 - 1)),
        Decision("m", "b1", ()),
        Decision("other", "b0", tuple(range(2**63, 2**63 + 100))),
    ]
    fields = encode("replica-1", batch, SECRET)
    assert origin_of(fields) == "replica-1"
    assert [(d.model, d.backend, tuple(d.blocks)) for d in decode(fields, SECRET)] == [
        (d.model, d.backend, tuple(d.blocks)) for d in batch
    ]
    assert len(fields[BLOCKS]) == SEAL + 8 * 103, "eight bytes a block, behind the nonce and check bytes"


def test_no_text_travels_only_names_sizes_and_sealed_hashes() -> None:
    blocks = (7, 8, 2**64 - 1)
    fields = encode("r", [Decision("m", "b0", blocks)], SECRET)
    assert orjson.loads(fields[HEADER]) == [["m", "b0", 3]]
    carried = array("Q", fields[BLOCKS][SEAL:])
    assert not set(carried) & set(blocks), "the hashes are not in the entry as they are"
    again = encode("r", [Decision("m", "b0", blocks)], SECRET)
    assert again[BLOCKS][SEAL:] != fields[BLOCKS][SEAL:], "a fresh nonce: equal chains look unrelated"


def test_an_entry_sealed_under_another_secret_is_refused() -> None:
    fields = encode("r", [Decision("m", "b0", (7, 8))], PrefixSecret(b"another-secret"))
    with pytest.raises(MalformedEntry, match="another cache-salt secret"):
        decode(fields, SECRET)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {HEADER: b"not json", BLOCKS: SECRET.seal(b"")},
        {HEADER: b"{}", BLOCKS: SECRET.seal(b"")},
        {HEADER: b'[["m", "b", 2]]', BLOCKS: SECRET.seal(b"\x00" * 8)},
        {HEADER: b'[["m", "b", 1]]', BLOCKS: SECRET.seal(b"\x00" * 12)},
        {HEADER: b'[["m", "b", -1]]', BLOCKS: SECRET.seal(b"")},
        {HEADER: b'[["m", 3, 0]]', BLOCKS: SECRET.seal(b"")},
        {HEADER: b'[["m", "b", 0]]', BLOCKS: SECRET.seal(b"\x00" * 8)},
        {HEADER: b'[["m", "b", 1]]', BLOCKS: b"\x00" * 8},
        {HEADER: b'[["m", "b", 0]]', BLOCKS: b""},
    ],
    ids=[
        "no fields",
        "a header that is not JSON",
        "a header that is not a list",
        "fewer blocks than the header counts",
        "blocks that are not whole hashes",
        "a negative count",
        "a backend that is not a name",
        "more blocks than the header counts",
        "blocks that were never sealed",
        "blocks too short to be sealed",
    ],
)
def test_an_entry_whose_parts_disagree_is_refused(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedEntry):
        decode(fields, SECRET)


def test_corrections_travel_as_names_and_ages_beside_the_decisions() -> None:
    corrections = [Correction("m", "b0", 1.5), Correction("other", "b1", 0.0)]
    fields = encode("r", [Decision("m", "b0", (1, 2))], SECRET, corrections)
    assert orjson.loads(fields[CORRECTIONS]) == [["m", "b0", 1500], ["other", "b1", 0]]
    assert decode_corrections(fields) == corrections
    assert [tuple(d.blocks) for d in decode(fields, SECRET)] == [(1, 2)]
    only = encode("r", [], SECRET, corrections[:1])
    assert decode(only, SECRET) == [], "a correction alone is an entry"
    assert decode_corrections(only) == corrections[:1]
    assert CORRECTIONS not in encode("r", [Decision("m", "b0", (1,))], SECRET), "no field when nothing to correct"


@pytest.mark.parametrize("raw", [b"{", b'{"m": 1}', b'[["m", "b0"]]', b'[["m", "b0", -1]]', b'[["m", 3, 10]]'])
def test_a_malformed_correction_is_refused(raw: bytes) -> None:
    fields = {**encode("r", [], SECRET), CORRECTIONS: raw}
    with pytest.raises(MalformedEntry):
        decode_corrections(fields)
