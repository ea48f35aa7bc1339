"""The simulator's ``BlockStored`` events carry vLLM's chain: each stored block's parent is the
block before it (None at a prompt's start) and its ``block_size`` token ids, in both engines
(the scheduler's and the fixed one) and on the wire of a simulator process."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq

import httpx

from gateway.kv_events.subscriber import KvEventSubscriber, KvFeed
from gateway.kv_events.wire import BlockStored
from loadtests.sim import SIM_MODEL_NAME
from loadtests.sim.kvcache import KVCache, chain_hashes, salt_root
from loadtests.sim.scheduler import Scheduler, Sequence
from tests.servers import free_port
from tests.sim.test_kv_events_publish import Events, until
from tests.sim.test_usage_cli import _sim

BS = 16


class Stored:
    """A ``KVCacheObserver`` keeping every stored block as (hash, parent, token ids)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int | None, list[int]]] = []

    def stored(self, block_hash: int, parent: int | None, token_ids: Seq[int]) -> None:
        self.blocks.append((block_hash, parent, list(token_ids)))

    def removed(self, block_hash: int) -> None: ...


def _drain(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.has_work():
            return
        sched.complete(sched.schedule(), lambda seq: None)
    raise AssertionError("the scheduler did not drain")


def test_the_schedulers_stored_blocks_chain_from_none_with_their_tokens() -> None:
    kv = KVCache(64, BS)
    seen = Stored()
    kv.observe(seen)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4096)
    prompt = list(range(100, 200))
    sched.add(Sequence("a", prompt, 2))
    _drain(sched)
    chain = chain_hashes(salt_root(None), prompt, 0, len(prompt) // BS, BS)
    assert [h for h, _, _ in seen.blocks] == chain
    assert [p for _, p, _ in seen.blocks] == [None, *chain[:-1]]
    assert [t for _, _, t in seen.blocks] == [prompt[i * BS : (i + 1) * BS] for i in range(len(chain))]


def test_a_shared_prefix_continues_the_chain_from_its_last_cached_block() -> None:
    kv = KVCache(64, BS)
    seen = Stored()
    kv.observe(seen)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4096)
    first = list(range(48))
    sched.add(Sequence("a", first, 1))
    _drain(sched)
    seen.blocks.clear()
    second = [*first[:32], *range(900, 932)]
    sched.add(Sequence("b", second, 1))
    _drain(sched)
    chain = chain_hashes(salt_root(None), second, 0, 4, BS)
    assert seen.blocks == [(chain[2], chain[1], second[32:48]), (chain[3], chain[2], second[48:64])]


async def test_a_simulator_process_publishes_chained_blocks_with_their_token_ids() -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with _sim("--kv-events", pub, "--kv-events-replay", replay) as url:
        events = Events()
        feed = KvFeed(endpoint=pub, replay_endpoint=replay)  # a late SUB gets what it missed replayed
        task = asyncio.create_task(KvEventSubscriber("sim", feed, sink=events, observer=events).run())
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                prompt = list(range(5000, 5100))
                chain = chain_hashes(salt_root(None), prompt, 0, len(prompt) // BS, BS)
                body = {"model": SIM_MODEL_NAME, "prompt": prompt, "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                # A SUB that joined after that batch hears of it at the next one (a gap, replayed):
                # other prompts make batches until it has.
                for k in range(1, 200):
                    if set(chain) <= set(events.stored()):
                        break
                    filler = {"model": SIM_MODEL_NAME, "prompt": [k, *range(9000, 9020)], "max_tokens": 1}
                    assert (await client.post("/v1/completions", json=filler)).status_code == 200
                await until(lambda: set(chain) <= set(events.stored()), "the prompt's blocks")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    held: list[int | bytes] = list(chain)
    runs = [e for e in events.events() if isinstance(e, BlockStored) and set(e.block_hashes) <= set(held)]
    hashes = [h for e in runs for h in e.block_hashes]
    assert hashes == chain
    for run in runs:
        first = held.index(run.block_hashes[0])
        assert run.parent_block_hash == (chain[first - 1] if first else None)
        assert run.block_size == BS
        assert list(run.token_ids) == prompt[first * BS : (first + len(run.block_hashes)) * BS]
