"""Saturation signals scraped from each backend's own ``/metrics``.

The gateway counts only its own in-flight work; a backend may also serve other gateways or
be slower than its policy capacity says. Its own metrics tell: how many requests wait in
its scheduler and how full its KV cache is. Names differ by engine:

=================  ==============================  ======================  ==============================
signal             vLLM                            SGLang                  llama.cpp (``--metrics``)
=================  ==============================  ======================  ==============================
waiting requests   ``vllm:num_requests_waiting``   ``sglang:num_queue_     ``llamacpp:requests_deferred``
                                                   reqs``                  (no free slot)
running requests   ``vllm:num_requests_running``   ``sglang:num_running_   ``llamacpp:requests_processing``
                                                   reqs``
KV cache usage     ``vllm:kv_cache_usage_perc``    ``sglang:token_usage``  none
                   (``vllm:gpu_cache_usage_perc``
                   before v0.10)
=================  ==============================  ======================  ==============================

Each kind's names are in its record (``EngineKind.metrics``, ``gateway/engines.py``; the
simulator's are vLLM's, an OpenAI server has none). The scraper reads the union of every kind's
names on every page, whatever the backend's declared kind: no name belongs to two engines, and a
vLLM declared as ``openai`` still reports its load.
Values are summed over label sets (one per engine or model) except KV usage, the maximum.
What dispatch does with them (``capacity.py``): an engine with requests waiting in its own queue
(above ``capacity.max_waiting``, 0 by default) gets no new request until a scrape finds it
drained; the signals count only while fresh (``scrape.fresh_s``: three intervals, at least a
second), so a backend whose scrapes fail or stop is not held on an old page.
Parsing is a line scan for these names only: a full exposition parse of a vLLM page costs
milliseconds, which matters at one scrape per backend per second.

Restarts: an engine that restarts between two health checks (a crash and a supervisor's quick
restart, a rolling update) never looks down, yet its prefix cache is empty, and a router that
still believes it holds the prefixes it served would keep sending them there for nothing. The
page tells: ``process_start_time_seconds`` changes, or the work counters (prompt and generated
tokens, finished requests; counters only ever grow within one process) go backwards. Either
makes the scraper call ``BackendPool.restarted``, which voids what routers learnt about the
backend. A restart is only seen from the second scrape of a process on, and a restarted engine
that served more than its predecessor before its first scrape goes unnoticed by the counters
(not by the start time): engines take seconds to load weights, scrapes come every second.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gateway.clock import Clock
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.engines import ENGINES, ScrapedMetrics

log = logging.getLogger(__name__)


def _every_kind(signal: Callable[[ScrapedMetrics], tuple[str, ...]]) -> tuple[bytes, ...]:
    """One signal's names over every kind's record, in the table's order, each once."""
    return tuple(dict.fromkeys(name.encode() for record in ENGINES.values() for name in signal(record.metrics)))


_WAITING = _every_kind(lambda m: m.waiting)
_RUNNING = _every_kind(lambda m: m.running)
_KV = _every_kind(lambda m: m.kv_usage)
_START = b"process_start_time_seconds"
_COUNTERS = _every_kind(lambda m: m.counters)


@dataclass(frozen=True, slots=True)
class Saturation:
    waiting: float
    running: float
    kv_usage: float
    started_at: float | None = None
    """``process_start_time_seconds``, when the page has it."""
    counters: tuple[float, ...] = ()
    """The work counters (``_COUNTERS``, each summed over its label sets), for restart detection."""


def restarted(before: Saturation, after: Saturation) -> bool:
    """Whether ``after`` was scraped from another process than ``before`` (module docstring)."""
    if before.started_at is not None and after.started_at is not None and before.started_at != after.started_at:
        return True
    return any(b > a for b, a in zip(before.counters, after.counters, strict=True))


def parse_saturation(page: bytes) -> Saturation:
    """The signals from a Prometheus text page; absent metrics read as 0 (the start time as None)."""
    waiting = running = kv = 0.0
    started_at: float | None = None
    counters = [0.0] * len(_COUNTERS)
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
        elif name in _COUNTERS:
            counters[_COUNTERS.index(name)] += _value(line)
        elif name == _START:
            started_at = _value(line)
    return Saturation(waiting, running, kv, started_at, tuple(counters))


def _value(line: bytes) -> float:
    """A sample's value; 0 (as if idle) when it is not a finite number: a ``NaN`` or ``+Inf`` from
    a confused engine must neither block dispatch to it for ever nor look like room."""
    try:
        rest = line.rsplit(b"}", 1)[-1] if b"}" in line else line.split(None, 1)[1]  # after labels, or the name
        value = float(rest.split()[0])
    except (ValueError, IndexError):
        return 0.0
    return value if math.isfinite(value) else 0.0


class SaturationScraper:
    """Scrapes every backend on an interval and calls ``on_change`` after each round.

    Keeps each backend's last page signals to detect a restart (module docstring); they are
    dropped while the backend is down (its index was voided then) or replaced by a reload.
    """

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, clock: Clock, on_change: Callable[[], None]):
        self._pool = pool
        self._client = client
        self._clock = clock
        self._on_change = on_change
        self._last: dict[str, tuple[BackendState, Saturation]] = {}

    async def scrape_once(self, timeout_s: float) -> None:
        states = [s for s in self._pool.all() if s.healthy]
        live = {id(s) for s in states}
        self._last = {name: seen for name, seen in self._last.items() if id(seen[0]) in live}
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
        last = self._last.get(state.name)
        if last is not None and last[0] is state and state.healthy and restarted(last[1], signals):
            self._pool.restarted(state)
        self._last[state.name] = (state, signals)
        state.waiting = signals.waiting
        state.finished_since_scrape = 0
        state.kv_usage = signals.kv_usage
        state.scraped_at = self._clock.now()

    async def run(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await self.scrape_once(timeout_s)
            await asyncio.sleep(interval_s)
