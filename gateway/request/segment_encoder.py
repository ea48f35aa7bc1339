"""A rendered chat's token ids without tokenizing again what an earlier turn already tokenized.

Why: routing on an engine's KV events needs the request's token ids as the engine computes them
(``engine_tokens.py``), and a BPE tokenizer costs 1 to 2 µs a token on the event loop (Llama 3's:
about 5 ms for a 3,300-token chat, 28 ms for 13,000, ``loadtests/proofs/engine_keys_cost.py``).
A conversation sends its whole history again at every turn, so most of that work was done before.

How: Hugging Face ``tokenizers`` first splits a text at its added tokens (a chat template's
special tokens: ``<|im_start|>``, ``<|eot_id|>``, ...) and encodes each piece between them on its
own. The ids of a rendered chat are therefore the ids of its pieces, in order, with the added
tokens' own ids between them; each message's piece is the same text turn after turn, so its ids
are cached by the piece's 128-bit xxh3 (and length), a bounded LRU. A turn then costs the hash of
the history (~0.1 µs a KiB) and the encoding of what is new.

Exact, or not used:

* added tokens that strip the spaces beside them or match whole words only (``lstrip``,
  ``rstrip``, ``single_word``), or that match on normalized text while a normalizer runs, move
  the split's edges: such a tokenizer is always encoded whole;
* a pre-tokenizer that treats a text's first piece apart (SentencePiece's ``Metaspace`` with
  ``prepend_scheme: first``) would give a piece alone other ids than in place. The encoder checks
  itself: its first ``VERIFY_FIRST`` texts, then one in ``VERIFY_EVERY``, are also encoded whole,
  and one difference turns it off for good (a WARNING naming the first differing id), after which
  every text is encoded whole.

Only ``add_special_tokens=False`` goes piecewise (the chat path: the template writes the BOS);
a post-processor's tokens are the tokenizer's to add.
"""

from __future__ import annotations

import json
import logging
import re

from tokenizers import Tokenizer

from gateway.request.text_cache import TextCache

log = logging.getLogger(__name__)

VERIFY_FIRST = 32
"""Texts encoded both ways when the encoder starts: a tokenizer whose pieces differ shows it at once."""
VERIFY_EVERY = 256
"""After those, one text in this many is encoded both ways as well."""
DEFAULT_CACHE_ENTRIES = 8192
DEFAULT_MIN_CACHED_CHARS = 64


class SegmentEncoder:
    """Encodes text as ``tokenizer.encode(text, add_special_tokens=False).ids``, piecewise and cached
    (module docstring). One per tokenizer, shared by the models naming it; event loop only."""

    __slots__ = ("_added_ids", "_cache", "_min_cached_chars", "_pattern", "_seen", "_tokenizer", "piecewise")

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        min_cached_chars: int = DEFAULT_MIN_CACHED_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self._min_cached_chars = min_cached_chars
        self._cache: TextCache[tuple[int, ...]] = TextCache(max_entries)
        self._added_ids = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
        self._pattern = _split_pattern(list(self._added_ids))
        self.piecewise = self._pattern is not None and _splits_cleanly(tokenizer)
        """False: every text is encoded whole (a tokenizer whose pieces are not exact, module docstring)."""
        self._seen = 0

    @property
    def hits(self) -> int:
        return self._cache.hits

    @property
    def misses(self) -> int:
        return self._cache.misses

    def encode(self, text: str) -> list[int]:
        if not self.piecewise or self._pattern is None:
            return self._whole(text)
        ids = self._piecewise(text, self._pattern)
        self._seen += 1
        if self._seen <= VERIFY_FIRST or self._seen % VERIFY_EVERY == 0:
            whole = self._whole(text)
            if whole != ids:
                self._turn_off(whole, ids)
                return whole
        return ids

    def _piecewise(self, text: str, pattern: re.Pattern[str]) -> list[int]:
        ids: list[int] = []
        added = self._added_ids
        for i, piece in enumerate(pattern.split(text)):
            if i % 2:  # the split's captured separators: an added token
                ids.append(added[piece])
            elif piece:
                ids.extend(self._cached(piece))
        return ids

    def _cached(self, piece: str) -> tuple[int, ...] | list[int]:
        if len(piece) < self._min_cached_chars:
            return self._whole(piece)
        return self._cache.get(piece, lambda text: tuple(self._whole(text)))

    def _whole(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def _turn_off(self, whole: list[int], pieces: list[int]) -> None:
        at = next(
            (i for i, (a, b) in enumerate(zip(whole, pieces, strict=False)) if a != b), min(len(whole), len(pieces))
        )
        log.warning(
            "this tokenizer's pieces between its added tokens do not encode as the whole text does (first "
            "difference at id %d of %d): engine token ids are computed whole from now on, without the cache",
            at,
            len(whole),
        )
        self.piecewise = False
        self._cache.clear()

    def __repr__(self) -> str:
        return f"SegmentEncoder(piecewise={self.piecewise}, entries={len(self._cache)}, hits={self.hits})"


def _split_pattern(contents: list[str]) -> re.Pattern[str] | None:
    """Leftmost-longest match of any added token (as the tokenizer's own split), captured."""
    if not contents:
        return None
    alternatives = sorted((c for c in contents if c), key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in alternatives) + ")")


def _splits_cleanly(tokenizer: Tokenizer) -> bool:
    """No added token moves the split's edges (module docstring), read from the tokenizer's own JSON."""
    document = json.loads(tokenizer.to_str())
    normalizes = document.get("normalizer") is not None
    for token in document.get("added_tokens") or ():
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
        if token.get("normalized") and normalizes:
            return False
    return True
