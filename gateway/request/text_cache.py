"""A bounded LRU of what was computed from a text, keyed by the text's 128-bit xxh3 and length.

Why one: a conversation sends its earlier messages again at every turn, and two things are
computed per message text on the request path: its token count (``tokenizer.py``) and its token
ids between a chat template's special tokens (``segment_encoder.py``). Both keep them here, so a
turn costs the hash of its history (~0.1 µs a KiB) and the work on what is new. The text itself is
not kept (a key is two ints); a hash collision (2^-128) would give a text another text's value, and
nothing else is shared between requests. Event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

V = TypeVar("V")


class TextCache(Generic[V]):
    """``value(text)`` computed once per text while it stays among the ``max_entries`` most recent."""

    __slots__ = ("_entries", "hits", "max_entries", "misses")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, int], V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str, compute: Callable[[str], V]) -> V:
        data = text.encode("utf-8", "surrogatepass")
        key = (xxhash.xxh3_128_intdigest(data), len(data))
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        value = self._entries[key] = compute(text)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()
