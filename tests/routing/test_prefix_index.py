"""The per-backend prefix index: matches, LRU bound, TTL, forgetting a backend."""

from __future__ import annotations

from gateway.routing.prefix_index import BackendIndexes, PrefixIndex


def test_a_served_chain_matches_in_full_and_its_extension_matches_its_prefix() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=60)
    index.insert([1, 2, 3], now=0)
    assert index.match([1, 2, 3], now=1) == 3
    assert index.match([1, 2, 3, 4, 5], now=1) == 3
    assert index.match([9, 10, 11], now=1) == 0


def test_the_lru_bound_evicts_the_tips_of_old_chains_first() -> None:
    index = PrefixIndex(max_blocks=4, ttl_s=60)
    index.insert([1, 2, 3], now=0)
    index.insert([7, 8], now=1)
    assert len(index) == 4
    assert index.match([1, 2, 3], now=1) == 2  # the tip (3) went, the root stays: still a prefix
    assert index.match([7, 8], now=1) == 2


def test_a_chain_longer_than_the_bound_keeps_its_root() -> None:
    index = PrefixIndex(max_blocks=2, ttl_s=60)
    index.insert([1, 2, 3, 4], now=0)
    assert index.match([1, 2, 3, 4], now=0) == 2


def test_entries_older_than_the_ttl_no_longer_match() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=10)
    index.insert([1, 2], now=0)
    index.insert([1, 2, 3], now=8)
    assert index.match([1, 2, 3], now=9) == 3
    assert index.match([1, 2, 3], now=18.5) == 0
    index.insert([5], now=30)
    assert len(index) == 1  # expired entries are purged on insert


def test_reinserting_a_shared_root_refreshes_it_for_every_chain() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=10)
    index.insert([1, 2, 3], now=0)
    index.insert([1, 9], now=9)
    assert index.match([1, 2, 3], now=12) == 1  # 2 and 3 expired, 1 was refreshed


def test_forgetting_a_backend_drops_only_its_index() -> None:
    indexes = BackendIndexes(ttl_s=60)
    indexes.insert("a", 100, [1, 2], now=0)
    indexes.insert("b", 100, [1, 2], now=0)
    indexes.forget("a")
    assert indexes.match("a", [1, 2], now=0) == 0
    assert indexes.match("b", [1, 2], now=0) == 2


def test_forgetting_before_a_time_drops_every_block_served_no_later_and_keeps_the_rest() -> None:
    index = PrefixIndex(max_blocks=100, ttl_s=60)
    index.insert([1, 2, 3], now=0)
    index.insert([7, 8], now=1)
    index.insert([1, 9], now=2)  # the shared root 1 served again later
    assert (index.served_at(3), index.served_at(1), index.served_at(42)) == (0, 2, None)
    assert index.forget_before(1) == 4  # 2, 3 (at 0), 7, 8 (at 1)
    assert index.match([1, 2, 3], now=2) == 1, "the root survives: it was served after"
    assert index.match([7, 8], now=2) == 0
    assert index.match([1, 9], now=2) == 2
    assert index.forget_before(-1) == 0


def test_forgetting_before_a_time_touches_only_that_backend() -> None:
    indexes = BackendIndexes(ttl_s=60)
    indexes.insert("a", 100, [1, 2], now=0)
    indexes.insert("b", 100, [1, 2], now=0)
    assert indexes.forget_before("a", 0) == 2
    assert indexes.forget_before("missing", 0) == 0
    assert (indexes.match("a", [1, 2], now=0), indexes.match("b", [1, 2], now=0)) == (0, 2)
