"""The bytes of the fleet's prefix view: a batch of routing decisions as one Redis stream entry.

A decision is ``(model, backend, blocks)``: the prompt's chained block hashes under its
tenant's scope (``gateway/routing/prefix_keys.py``) and the backend it was sent to. No text
and no tenant name travel, and two tenants' hashes never collide because each chain is seeded
with a root of its tenant's scope. The blocks travel sealed with the cache-salt secret
(``gateway/routing/prefix_secret.py``): a chain hash seeds the next, so hashes in the clear
would let whoever reads the stream check a guessed continuation of a prompt; sealed, they are
noise to anyone without the secret, and only the replicas sharing it (the ones sharing the
stream) open them.

One entry holds every decision a process made since its last flush, in three fields:

* ``o``: the publishing process's id (a process skips its own entries);
* ``h``: JSON ``[[model, backend, block_count], ...]`` (in the clear: names and sizes only);
* ``k``: every decision's blocks end to end, as little-endian unsigned 64-bit integers
  (8 bytes a block, packed and unpacked in C by ``array``; JSON would take about 20), sealed
  (``PrefixSecret.seal``: 24 bytes of nonce and check, then the blocks XOR a keystream).

and, when some of this process's answers showed an engine holding less than its index predicted
(``gateway/dispatch/cache_report.py``), a fourth:

* ``c``: JSON ``[[model, backend, age_ms], ...]``: that engine evicted what it was last sent
  ``age_ms`` before the entry was written (names and ages only, no hash: nothing to seal); each
  reader forgets what it sent or learnt it sent there until then.

``decode`` refuses an entry sealed under another secret, or whose header does not match its
blocks (``MalformedEntry``): a reader skips it rather than fold a wrong chain into its index.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import orjson

from gateway.routing.prefix_secret import PrefixSecret

ORIGIN, HEADER, BLOCKS, CORRECTIONS, SPAN = b"o", b"h", b"k", b"c", b"s"


class Decision(NamedTuple):
    """One routing decision as the other processes learn it."""

    model: str
    backend: str
    blocks: Sequence[int]


class Correction(NamedTuple):
    """An engine held less than predicted: it evicted what it was last sent ``age_s`` ago."""

    model: str
    backend: str
    age_s: float


class MalformedEntry(ValueError):
    """A stream entry that is not a batch of decisions (another writer, a truncated entry)."""


def encode(
    origin: str,
    decisions: Sequence[Decision],
    secret: PrefixSecret,
    corrections: Sequence[Correction] = (),
    span_s: float = 0.0,
) -> dict[bytes, bytes]:
    """The stream entry's fields for ``decisions`` and ``corrections``, the blocks sealed with
    ``secret`` (module docstring); ``span_s``: how long before the entry its oldest decision was made."""
    header = [[d.model, d.backend, len(d.blocks)] for d in decisions]
    packed = array("Q")
    for decision in decisions:
        packed.extend(decision.blocks)
    if sys.byteorder == "big":
        packed.byteswap()
    fields = {ORIGIN: origin.encode(), HEADER: orjson.dumps(header), BLOCKS: secret.seal(packed.tobytes())}
    if corrections:
        fields[CORRECTIONS] = orjson.dumps([[c.model, c.backend, round(c.age_s * 1000)] for c in corrections])
    if decisions and span_s > 0:
        fields[SPAN] = str(round(span_s * 1000)).encode()
    return fields


def decode_span(fields: Mapping[bytes, bytes]) -> float:
    """Seconds before the entry its oldest decision was made (0 when the entry does not say, as a
    writer before this field did not); ``MalformedEntry`` when it is not a count of milliseconds."""
    raw = fields.get(SPAN)
    if raw is None:
        return 0.0
    if not raw.isdigit():
        raise MalformedEntry(f"the span is not a count of milliseconds: {raw!r:.40}")
    return int(raw) / 1000


def decode_corrections(fields: Mapping[bytes, bytes]) -> list[Correction]:
    """The corrections of one entry (none when it has no ``c`` field); ``MalformedEntry`` when the
    field is not a list of ``[model, backend, age_ms]``."""
    raw = fields.get(CORRECTIONS)
    if raw is None:
        return []
    try:
        items = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedEntry(f"corrections are not JSON: {exc}") from exc
    if not isinstance(items, list):
        raise MalformedEntry("the corrections are not a list")
    corrections = []
    for item in items:
        if not _is_triple(item):
            raise MalformedEntry(f"a correction is not [model, backend, age_ms]: {item!r:.80}")
        corrections.append(Correction(item[0], item[1], item[2] / 1000))
    return corrections


def _is_triple(item: object) -> bool:
    """``[model, backend, n]`` with a count or an age that is a non-negative int: the shape of a
    header item and of a correction alike."""
    return (
        isinstance(item, list)
        and len(item) == 3
        and isinstance(item[0], str)
        and isinstance(item[1], str)
        and isinstance(item[2], int)
        and item[2] >= 0
    )


def origin_of(fields: Mapping[bytes, bytes]) -> str:
    return fields.get(ORIGIN, b"").decode(errors="replace")


def decode(fields: Mapping[bytes, bytes], secret: PrefixSecret) -> list[Decision]:
    """The decisions of one entry; ``MalformedEntry`` when sealed under another secret or when its
    parts disagree."""
    try:
        header = orjson.loads(fields[HEADER])
        sealed = fields[BLOCKS]
    except (KeyError, orjson.JSONDecodeError) as exc:
        raise MalformedEntry(f"not a prefix-view entry: {exc}") from exc
    raw = secret.unseal(sealed)
    if raw is None:
        raise MalformedEntry("sealed under another cache-salt secret")
    if len(raw) % 8:
        raise MalformedEntry("blocks are not a whole number of 64-bit hashes")
    packed = array("Q")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    decisions, at = [], 0
    if not isinstance(header, list):
        raise MalformedEntry("the header is not a list")
    for item in header:
        if not _is_triple(item):
            raise MalformedEntry(f"a header item is not [model, backend, count]: {item!r:.80}")
        decisions.append(Decision(item[0], item[1], packed[at : at + item[2]]))
        at += item[2]
    if at != len(packed):
        raise MalformedEntry(f"the header counts {at} blocks, the entry holds {len(packed)}")
    return decisions
