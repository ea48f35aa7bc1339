"""Saturation signals scraped from each backend's own ``/metrics``.

The gateway counts only its own in-flight work; a backend may also serve other gateways or
be slower than its policy capacity says. Its own metrics tell: how many requests wait in
its scheduler and how full its KV cache is. Names differ by engine:

=================  ==============================  ====================================
signal             vLLM                            SGLang
=================  ==============================  ====================================
waiting requests   ``vllm:num_requests_waiting``   ``sglang:num_queue_reqs``
running requests   ``vllm:num_requests_running``   ``sglang:num_running_reqs``
KV cache usage     ``vllm:kv_cache_usage_perc``    ``sglang:token_usage``
                   (``vllm:gpu_cache_usage_perc``
                   before v0.10)
=================  ==============================  ====================================

Values are summed over label sets (one per engine or model) except KV usage, the maximum.
Parsing is a line scan for these names only: a full exposition parse of a vLLM page costs
milliseconds, which matters at one scrape per backend per second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gateway.clock import Clock
from gateway.endpoints import BackendPool, BackendState

log = logging.getLogger(__name__)

_WAITING = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs")
_RUNNING = (b"vllm:num_requests_running", b"sglang:num_running_reqs")
_KV = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc", b"sglang:token_usage")


@dataclass(frozen=True, slots=True)
class Saturation:
    waiting: float
    running: float
    kv_usage: float


def parse_saturation(page: bytes) -> Saturation:
    """The three signals from a Prometheus text page; absent metrics read as 0."""
    waiting = running = kv = 0.0
    for line in page.splitlines():
        if not line or line[0] == 35:  # '#'
            continue
        name_end = min((i for i in (line.find(b"{"), line.find(b" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name in _WAITING:
            waiting += _value(line)
        elif name in _RUNNING:
            running += _value(line)
        elif name in _KV:
            kv = max(kv, _value(line))
    return Saturation(waiting, running, kv)


def _value(line: bytes) -> float:
    try:
        return float(line.rsplit(b"}", 1)[-1].split()[0])
    except (ValueError, IndexError):
        return 0.0


class SaturationScraper:
    """Scrapes every backend on an interval and calls ``on_change`` after each round."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, clock: Clock, on_change: Callable[[], None]):
        self._pool = pool
        self._client = client
        self._clock = clock
        self._on_change = on_change

    async def scrape_once(self, timeout_s: float) -> None:
        states = [s for s in self._pool.all() if s.healthy]
        await asyncio.gather(*(self._scrape(s, timeout_s) for s in states))
        self._on_change()

    async def _scrape(self, state: BackendState, timeout_s: float) -> None:
        try:
            response = await self._client.get(state.backend.url + "/metrics", timeout=timeout_s)
        except httpx.HTTPError as exc:
            log.debug("scrape of %s failed: %s", state.name, exc)
            return
        if response.status_code != 200:
            return
        signals = parse_saturation(response.content)
        state.waiting = signals.waiting
        state.kv_usage = signals.kv_usage
        state.scraped_at = self._clock.now()

    async def run(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await self.scrape_once(timeout_s)
            await asyncio.sleep(interval_s)
