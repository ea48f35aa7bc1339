"""``inference-gateway sim --kv-events``: a simulator in a process of its own publishes vLLM's KV
events, which the gateway's subscriber decodes: a fresh engine's ``AllBlocksCleared``, the
blocks a prompt stored (the simulator's own chain hashes), and evictions under a small cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from gateway.kv_events.subscriber import KvEventSubscriber, KvFeed, LostReason
from gateway.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from loadtests.sim import SIM_MODEL_NAME
from loadtests.sim.kvcache import chain_hashes, salt_root
from tests.servers import free_port
from tests.sim.test_usage_cli import _sim

SMALL_CACHE = "0.22628"  # --gpu-memory-utilization giving the fixed profile 20 blocks of 16 tokens


class Events:
    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def apply(self, backend: str, batch: EventBatch) -> None:
        self.batches.append(batch)

    def on_live(self, backend: str) -> None: ...

    def on_lost(self, backend: str, reason: LostReason) -> None: ...

    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]

    def stored(self) -> list[int | bytes]:
        return [h for e in self.events() if isinstance(e, BlockStored) for h in e.block_hashes]

    def removed(self) -> list[int | bytes]:
        return [h for e in self.events() if isinstance(e, BlockRemoved) for h in e.block_hashes]


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_a_prompt_stores_its_chain_and_a_small_cache_evicts() -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    flags = ("--kv-events", pub, "--kv-events-replay", replay, "--gpu-memory-utilization", SMALL_CACHE)
    with _sim(*flags) as url:
        events = Events()
        feed = KvFeed(endpoint=pub, replay_endpoint=replay)
        task = asyncio.create_task(KvEventSubscriber("sim", feed, sink=events, observer=events).run())
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                prompts = [list(range(1000 * k, 1000 * k + 100)) for k in range(1, 6)]
                answer = await client.post(
                    "/v1/completions", json={"model": SIM_MODEL_NAME, "prompt": prompts[0], "max_tokens": 2}
                )
                assert answer.status_code == 200
                chain = chain_hashes(salt_root(None), prompts[0], 0, 100 // 16, 16)
                await until(lambda: events.stored()[: len(chain)] == chain, "the prompt's blocks stored")
                assert events.events()[0] == AllBlocksCleared()  # a fresh engine, replayed to a late subscriber
                for prompt in prompts[1:]:
                    body = {"model": SIM_MODEL_NAME, "prompt": prompt, "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                await until(lambda: bool(events.removed()), "an eviction")
                assert set(events.removed()) <= set(events.stored())
                assert chain[0] in events.removed()  # LRU: the first prompt's blocks go first
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
