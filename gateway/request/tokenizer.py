"""A model's own tokenizer as a ``TokenEstimator``: exact prompt counts, each text tokenized once.

Why: the character estimate (``gateway/request/tokens.py``) is a bound for most text but not
for all (random strings, scripts a vocabulary covers poorly), and a model's prompt cap or a
tenant's TPM is only as exact as the count. A model whose policy names a ``tokenizer.json``
(``TokenizerPolicy``) is counted with it: Hugging Face ``tokenizers`` (Rust), from a local file,
nothing downloaded.

**Counted as the engine counts the text.** ``encode(text, add_special_tokens=False)``: the chat
template's special tokens and role markers are the dialects' fixed overhead per message
(``MESSAGE_OVERHEAD_TOKENS``), not the tokenizer's. Truncation and padding saved in the file are
turned off: a truncating tokenizer would cap the count at its ``max_length`` and pass any prompt.

**A cached prefix is not tokenized twice.** A conversation sends its earlier messages again at
every turn; each message's content is a separate ``count`` (the dialects count per message), so a
bounded LRU keyed by the text's 128-bit xxh3 (and its length) makes every message but the new one
a dictionary hit: the cost of a turn is the hash of the history (~0.1 us a KiB) plus the
tokenization of the new message. Texts shorter than ``min_cached_chars`` skip the cache: for
them the lookup costs about what tokenizing does. A hash collision (2^-128) would give a text
another text's count; nothing else is shared between requests.

Cost: the tokenizer runs on the event loop, about 1-2 us per 100 characters for BPE vocabularies
(``loadtests/proofs/overhead.py --tokenizer`` measures it per request).

Usage::

    estimator = TokenizerEstimator.from_file("tokenizers/llama-3.1.json")
    estimator.count("Hello, world")          # the tokenizer's count, without special tokens
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from gateway.request.text_cache import TextCache

DEFAULT_CACHE_ENTRIES = 8192
"""Counts kept: a few hundred conversations' messages; an entry is two ints (about 200 bytes)."""

DEFAULT_MIN_CACHED_CHARS = 64
"""Texts shorter than this are tokenized every time: the hash and lookup would cost as much."""


class TokenizerEstimator:
    """Counts tokens with a ``tokenizers.Tokenizer``, caching counts by the text's hash (module docstring)."""

    __slots__ = ("_cache", "_min_cached_chars", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        min_cached_chars: int = DEFAULT_MIN_CACHED_CHARS,
    ) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._min_cached_chars = min_cached_chars
        self._cache: TextCache[int] = TextCache(max_entries)

    @property
    def hits(self) -> int:
        return self._cache.hits

    @property
    def misses(self) -> int:
        return self._cache.misses

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer itself (truncation and padding off): the engine's token ids for routing on its
        KV events (``gateway/request/engine_tokens.py``)."""
        return self._tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> TokenizerEstimator:
        """Load a ``tokenizer.json``; ``Exception`` (from the Rust side) when it cannot be read or parsed."""
        return cls(Tokenizer.from_file(str(path)))

    def count(self, text: str) -> int:
        if not text:
            return 0
        if len(text) < self._min_cached_chars:
            return self._encode(text)
        return self._cache.get(text, self._encode)

    def _encode(self, text: str) -> int:
        try:
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        except UnicodeEncodeError:  # a lone surrogate: counted as the engine would see it, replaced
            text = text.encode("utf-8", "replace").decode("utf-8")
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def __repr__(self) -> str:
        entries = f"{len(self._cache)}/{self._cache.max_entries}"
        return f"TokenizerEstimator(entries={entries}, hits={self.hits}, misses={self.misses})"
