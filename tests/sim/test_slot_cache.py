"""The slot-scoped prefix cache (llama.cpp's server with ``--cache-ram 0``) on the scheduler itself."""

from __future__ import annotations

import pytest

from loadtests.sim.kvcache import CacheScope, KVCache, SlotTable
from loadtests.sim.profiles import get_profile
from loadtests.sim.scheduler import Scheduler, Sequence

BS = 16


def make(slots: int, *, keep_idle: bool = True, similarity: float = 0.1) -> Scheduler:
    table = SlotTable(slots, BS, similarity=similarity, keep_idle=keep_idle)
    return Scheduler(KVCache(4096, BS), max_num_seqs=slots, max_num_batched_tokens=8192, slots=table)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def serve(sched: Scheduler, seq: Sequence) -> int:
    """Run ``seq`` alone to its end; the prompt tokens it found cached."""
    sched.add(seq)
    while sched.has_work():
        sched.complete(sched.schedule(), lambda _seq: None)
    return seq.num_cached_tokens


def test_a_next_turn_reuses_its_slot_token_exact() -> None:
    sched = make(4)
    first = Sequence("t1", prompt(100), 5)
    serve(sched, first)
    history = first.token_ids[:104]  # the prompt and the outputs fed back (the last one never was)
    assert serve(sched, Sequence("t2", history + prompt(50, 1000), 5)) == 104


def test_a_repeated_prompt_computes_one_token() -> None:
    sched = make(2)
    serve(sched, Sequence("a", prompt(64), 1))
    assert serve(sched, Sequence("b", prompt(64), 1)) == 63


def test_a_finished_prefix_is_lost_once_its_slot_is_reused() -> None:
    sched = make(2)
    serve(sched, Sequence("a", prompt(200), 1))
    serve(sched, Sequence("b", prompt(200, 5000), 1))
    assert serve(sched, Sequence("a2", prompt(200), 1)) == 199, "a's slot still held it"
    serve(sched, Sequence("c", prompt(200, 9000), 1))  # takes the least recently used slot: b's
    serve(sched, Sequence("d", prompt(200, 13000), 1))  # then a2's: a's prompt is gone
    assert serve(sched, Sequence("a3", prompt(200), 1)) == 0


def test_the_most_similar_idle_slot_wins_over_the_least_recently_used() -> None:
    sched = make(3)
    serve(sched, Sequence("a", prompt(100), 1))  # slot 0, least recently used
    serve(sched, Sequence("b", prompt(100, 5000), 1))
    serve(sched, Sequence("c", prompt(100, 9000), 1))
    assert serve(sched, Sequence("b2", prompt(100, 5000) + prompt(20, 100), 1)) == 100


def test_below_the_similarity_threshold_the_least_recently_used_slot_is_taken() -> None:
    sched = make(2, similarity=0.5)
    serve(sched, Sequence("a", prompt(100), 1))
    serve(sched, Sequence("b", prompt(100, 5000), 1))
    # shares 40 tokens of 200 with b (0.2 < 0.5): goes to a's slot, the least recently used
    assert serve(sched, Sequence("x", prompt(40, 5000) + prompt(160, 70000), 1)) == 0
    assert serve(sched, Sequence("b2", prompt(100, 5000), 1)) == 99, "b's slot was not touched"


def test_a_running_sequence_prefix_is_not_shared_across_slots() -> None:
    sched = make(2)
    long = Sequence("a", prompt(300), 50)
    sched.add(long)
    sched.complete(sched.schedule(), lambda _seq: None)  # a prefills and keeps running
    twin = Sequence("b", prompt(300), 1)
    sched.add(twin)
    sched.complete(sched.schedule(), lambda _seq: None)
    assert twin.num_cached_tokens == 0


def test_the_running_scope_forgets_a_prefix_when_its_sequence_ends() -> None:
    sched = make(4, keep_idle=False)
    serve(sched, Sequence("a", prompt(100), 1))
    assert serve(sched, Sequence("a2", prompt(100), 1)) == 0


@pytest.mark.parametrize(("salt_a", "salt_b", "cached"), [("t1", "t1", 99), ("t1", "t2", 0), (None, "t2", 0)])
def test_a_slot_is_reused_only_under_the_same_salt(salt_a: str | None, salt_b: str | None, cached: int) -> None:
    sched = make(1)
    serve(sched, Sequence("a", prompt(100), 1, cache_salt=salt_a))
    assert serve(sched, Sequence("b", prompt(100), 1, cache_salt=salt_b)) == cached


def test_no_block_reaches_the_shared_pool() -> None:
    sched = make(2)
    serve(sched, Sequence("a", prompt(160), 1))
    assert sched.kv.num_cached == 0
    assert sched.kv.num_free == sched.kv.num_blocks


def test_at_most_one_sequence_per_slot() -> None:
    sched = make(2)
    for i in range(5):
        sched.add(Sequence(f"r{i}", prompt(40, 1000 * i), 20))
    plan = sched.schedule()
    assert len(plan.scheduled) == 2
    assert {seq.slot for seq in sched.running} == {0, 1}


def test_profiles_take_the_scope_and_slot_count() -> None:
    profile = get_profile("llama-3.1-8b-h100", cache_scope="slots", max_num_seqs=4)
    assert (profile.cache_scope, profile.max_num_seqs) == (CacheScope.SLOTS, 4)
    assert get_profile("llama-3.1-8b-h100").cache_scope is CacheScope.POOL
    with pytest.raises(ValueError, match="roofline"):
        get_profile("fixed", cache_scope="slots")
