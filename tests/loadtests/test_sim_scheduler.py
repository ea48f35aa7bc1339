"""Prefix caching, salting, LRU eviction, preemption and priority, on the scheduler itself."""

from __future__ import annotations

import pytest

from loadtests.sim.kvcache import KVCache, chain_hashes, salt_root
from loadtests.sim.scheduler import Scheduler, Sequence, Status

BS = 16


def make(blocks: int, *, seqs: int = 8, budget: int = 4096) -> Scheduler:
    return Scheduler(KVCache(blocks, BS), max_num_seqs=seqs, max_num_batched_tokens=budget)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def run_to_end(sched: Scheduler) -> list[str]:
    """Step until idle; return request ids in the order they sampled their first token."""
    order: list[str] = []

    def on_token(seq: Sequence) -> None:
        if seq.num_output == 1:
            order.append(seq.req_id)

    for _ in range(10_000):
        if not sched.has_work():
            return order
        sched.complete(sched.schedule(), on_token)
    raise AssertionError("scheduler did not drain")


def test_hash_chain_depends_on_every_earlier_token() -> None:
    a = chain_hashes(salt_root(None), prompt(48), 0, 3, BS)
    changed = prompt(48)
    changed[0] = 999
    b = chain_hashes(salt_root(None), changed, 0, 3, BS)
    assert all(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("salt_a", "salt_b", "hit_tokens"),
    [(None, None, 32), ("tenant-a", "tenant-a", 32), ("tenant-a", "tenant-b", 0), (None, "tenant-b", 0)],
    ids=[
        "an unsalted repeat hits its full blocks",
        "a repeat under the same salt hits",
        "the same prefix under another salt never hits",
        "a salted request never hits an unsalted prefix",
    ],
)
def test_prefix_hits_respect_cache_salt(salt_a: str | None, salt_b: str | None, hit_tokens: int) -> None:
    sched = make(64)
    sched.add(Sequence("a", prompt(40), 2, cache_salt=salt_a))
    run_to_end(sched)
    second = Sequence("b", prompt(40), 2, cache_salt=salt_b)
    sched.add(second)
    plan = sched.schedule()
    assert (plan.prefix_queries, plan.prefix_hits) == (40, hit_tokens)
    assert second.num_cached_tokens == hit_tokens


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched = make(64)
    sched.add(Sequence("a", prompt(32), 1))
    run_to_end(sched)
    sched.add(Sequence("b", prompt(32), 1))
    plan = sched.schedule()
    assert plan.prefix_hits == 16
    assert plan.scheduled[0][1] == 16


def test_lru_eviction_drops_the_least_recently_freed_blocks_first_tail_first() -> None:
    sched = make(8)
    for name, offset in (("old", 0), ("new", 1000)):
        sched.add(Sequence(name, prompt(48, offset), 1))
        run_to_end(sched)
    sched.add(Sequence("fresh", prompt(64, 5000), 1))  # 4 blocks: 2 free, then 2 evicted
    run_to_end(sched)
    assert sched.kv.evictions == 2
    old = chain_hashes(salt_root(None), prompt(48), 0, 3, BS)
    new = chain_hashes(salt_root(None), prompt(48, 1000), 0, 3, BS)
    assert len(sched.kv.lookup(old)) == 1  # the old request lost its last two blocks
    assert len(sched.kv.lookup(new)) == 3  # the more recent one kept everything


def test_finished_requests_free_their_blocks_but_keep_them_cached() -> None:
    sched = make(16)
    sched.add(Sequence("a", prompt(64), 4))
    run_to_end(sched)
    assert sched.kv.usage() == 0.0
    assert sched.kv.num_cached == 4


def test_full_cache_preempts_the_lowest_priority_request_and_recomputes_it() -> None:
    sched = make(8, budget=64)
    high = Sequence("high", prompt(40), 40, priority=0)
    low = Sequence("low", prompt(40, 100), 40, priority=5)
    sched.add(high)
    sched.add(low)
    preempted = 0
    finished: list[str] = []

    def on_token(seq: Sequence) -> None:
        if seq.num_output == seq.max_tokens:
            finished.append(seq.req_id)

    for _ in range(1000):
        if not sched.has_work():
            break
        plan = sched.schedule()
        preempted += plan.preempted
        sched.complete(plan, on_token)
    assert preempted >= 1
    assert finished == ["high", "low"]
    assert low.num_output == 40
    assert low.status is Status.FINISHED


@pytest.mark.parametrize(
    ("priorities", "expected"),
    [((0, 0, 0), ["r0", "r1", "r2"]), ((5, 1, 3), ["r1", "r2", "r0"]), ((2, 1, 1), ["r1", "r2", "r0"])],
    ids=[
        "equal priorities run first come first served",
        "lower numbers run first",
        "ties within a priority keep arrival order",
    ],
)
def test_waiting_requests_are_admitted_by_priority_then_arrival(
    priorities: tuple[int, ...], expected: list[str]
) -> None:
    sched = make(64, seqs=1)
    for i, priority in enumerate(priorities):
        sched.add(Sequence(f"r{i}", prompt(20, 100 * i), 2, priority=priority))
    assert run_to_end(sched) == expected


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = make(64, budget=32)
    sched.add(Sequence("long", prompt(100), 1))
    sizes = []
    while sched.has_work():
        plan = sched.schedule()
        sizes.append(plan.shape.tokens)
        sched.complete(plan, lambda seq: None)
    assert sizes == [32, 32, 32, 4]


def test_abort_frees_blocks_immediately() -> None:
    sched = make(16)
    seq = Sequence("a", prompt(64), 100)
    sched.add(seq)
    sched.complete(sched.schedule(), lambda s: None)
    assert sched.kv.usage() > 0
    sched.abort(seq)
    assert sched.kv.usage() == 0.0
    assert not sched.has_work()


def test_a_stalled_sequence_is_parked_with_its_blocks_and_seat_until_aborted() -> None:
    sched = make(64, seqs=1)
    stalled = Sequence("stalled", prompt(40), 10)
    stalled.stall_at = 2
    sched.add(stalled)
    assert run_to_end(sched) == ["stalled"]
    assert (stalled.status, stalled.num_output, sched.num_parked) == (Status.PARKED, 2, 1)
    assert sched.kv.usage() > 0  # it keeps its blocks
    sched.add(Sequence("next", prompt(8, 1000), 1))
    assert sched.schedule().scheduled == []  # and its seat among max_num_seqs
    sched.abort(stalled)
    assert (stalled.status, sched.num_parked) == (Status.FINISHED, 0)
    assert run_to_end(sched) == ["next"]
