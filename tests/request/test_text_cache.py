"""``TextCache`` (``gateway/request/text_cache.py``): a value computed once per text, the least
recently used forgotten past the bound, a lone surrogate keyed like any text."""

from __future__ import annotations

from gateway.request.text_cache import TextCache


def test_a_text_seen_again_is_not_computed_again_and_the_oldest_goes_past_the_bound() -> None:
    computed: list[str] = []

    def length(text: str) -> int:
        computed.append(text)
        return len(text)

    cache: TextCache[int] = TextCache(max_entries=2)
    assert [cache.get(t, length) for t in ("a", "bb", "a", "ccc", "a", "bb")] == [1, 2, 1, 3, 1, 2]
    assert computed == ["a", "bb", "ccc", "bb"]  # "bb" was the least recently used when "ccc" came
    assert (cache.hits, cache.misses, len(cache)) == (2, 4, 2)


def test_a_lone_surrogate_is_a_text_like_any_other() -> None:
    cache: TextCache[str] = TextCache(max_entries=4)
    assert cache.get("\ud800x", str.upper) == "\ud800X"
    assert cache.get("\ud800x", str.lower) == "\ud800X"  # cached: not computed again
