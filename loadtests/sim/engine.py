"""Engines: the step loop that turns scheduled batches into timed tokens.

`BatchingEngine` (ROOFLINE profiles) runs vLLM-style continuous batching: each step is planned
by the `Scheduler`, priced by the `RooflineCostModel`, and its tokens are released when the step's
deadline passes. Deadlines are absolute — a step that starts while the previous one is due
starts at that previous deadline, not at "now" — so CPU jitter does not accumulate into lost
throughput; the lateness of each wake-up is recorded in ``sim:step_lag_seconds``.

`FixedEngine` (FIXED profile) gives every request its first token `ttft` after arrival and the
next ones every `itl`, with no batching effects; it still does prefix-cache accounting so that
the gateway's cache-aware routing sees hits. Both engines multiply every simulated duration by
`time_scale`.

Both key their KV blocks by ``hashing`` (``kvcache.BlockHashing``: the simulator's own chain by
default, vLLM's with ``sim --tokenizer``) and generate the ids ``output_id`` gives (the word
cycle's by default, the configured tokenizer's with ``--tokenizer``: ``tokenizer.py``).

An ``EngineRequest`` with ``stall_at`` (an injected fault, see ``faults.py``) stops producing
tokens after that many and keeps its slot and blocks until it is aborted.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loadtests.sim.clock import Clock, MonotonicClock
from loadtests.sim.costmodel import RooflineCostModel
from loadtests.sim.kvcache import BlockHash, BlockHashing, CacheScope, KVCache, SlotTable, block_chain
from loadtests.sim.metrics import EngineMetrics
from loadtests.sim.profiles import BLOCK_SIZE, Profile
from loadtests.sim.scheduler import Scheduler, Sequence
from loadtests.sim.stream import FinishReason, TokenStream
from loadtests.sim.tokenizer import output_token_id

MAX_CATCH_UP_S = 0.1  # beyond this lateness the timeline restarts from now instead of bursting
LAG_SAMPLES = 200_000


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the HTTP layer asks of an engine: tokens in, tokens out (0 = prefill only)."""

    token_ids: list[int]
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None
    stall_at: int | None = None  # injected stall: stop after this many tokens, keep the slot


class Engine(Protocol):
    """One simulated engine instance."""

    metrics: EngineMetrics
    max_model_len: int

    def submit(self, request: EngineRequest) -> TokenStream: ...
    def abort(self, stream: TokenStream) -> None: ...
    async def run(self) -> None: ...


class _Waker:
    """Sleep until a deadline or until poked, whichever comes first."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._future: asyncio.Future[None] | None = None

    def poke(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def sleep(self, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._future = future = loop.create_future()
        timer = None
        if deadline is not None:
            timer = loop.call_later(max(0.0, deadline - self._clock.now()), self.poke)
        try:
            await future
        finally:
            self._future = None
            if timer is not None:
                timer.cancel()


class _Timing:
    """Per-request timestamps for TTFT and ITL."""

    __slots__ = ("arrival", "last", "stream")

    def __init__(self, stream: TokenStream, arrival: float) -> None:
        self.stream = stream
        self.arrival = arrival
        self.last = arrival


class _EngineBase:
    def __init__(
        self,
        profile: Profile,
        *,
        model_name: str,
        index: int,
        time_scale: float,
        clock: Clock,
        hashing: BlockHashing | None = None,
        output_id: Callable[[int], int] = output_token_id,
    ) -> None:
        self.profile = profile
        self.time_scale = time_scale
        self.clock = clock
        self.output_id = output_id
        self.kv = KVCache(profile.num_kv_blocks, BLOCK_SIZE, hashing)
        self.max_model_len = self.kv.num_blocks * BLOCK_SIZE
        self.lag_samples: deque[float] = deque(maxlen=LAG_SAMPLES)
        self.tokens_out = 0  # tokens emitted, for benchmarks
        self._waker = _Waker(clock)
        self.metrics = EngineMetrics(
            model_name, index, running=self._num_running, waiting=self._num_waiting, kv_usage=self.kv.usage
        )

    def _num_running(self) -> float:
        raise NotImplementedError

    def _num_waiting(self) -> float:
        return 0.0

    def _record_lag(self, deadline: float) -> None:
        lag = self.clock.now() - deadline
        self.lag_samples.append(lag)
        self.metrics.step_lag.observe(max(0.0, lag))

    def _emit(self, timing: _Timing, index: int, now: float) -> None:
        if index == 0:
            self.metrics.ttft.observe(now - timing.arrival)
            timing.stream.first_at = now
        else:
            self.metrics.itl.observe(now - timing.last)
        timing.last = now
        self.tokens_out += 1
        timing.stream.push(index)

    def _finished(self, stream: TokenStream, reason: FinishReason, prompt_tokens: int) -> None:
        self.metrics.success[reason.value].inc()
        if reason is FinishReason.ABORT:
            self.metrics.aborted.inc()
        else:
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.metrics.generation_tokens.inc(stream.num_tokens)
        stream.end_at = self.clock.now()
        stream.finish(reason)


class BatchingEngine(_EngineBase):
    """Continuous batching on a roofline cost model (see the module docstring)."""

    def __init__(
        self,
        profile: Profile,
        *,
        model_name: str,
        index: int = 0,
        time_scale: float = 1.0,
        clock: Clock | None = None,
        hashing: BlockHashing | None = None,
        output_id: Callable[[int], int] = output_token_id,
    ) -> None:
        super().__init__(
            profile,
            model_name=model_name,
            index=index,
            time_scale=time_scale,
            clock=clock or MonotonicClock(),
            hashing=hashing,
            output_id=output_id,
        )
        self.cost = RooflineCostModel(profile)
        slots = None
        if profile.cache_scope is not CacheScope.POOL:
            slots = SlotTable(
                profile.max_num_seqs,
                BLOCK_SIZE,
                similarity=profile.slot_similarity,
                keep_idle=profile.cache_scope is CacheScope.SLOTS,
            )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            slots=slots,
            output_id=output_id,
        )
        self._by_stream: dict[TokenStream, Sequence] = {}
        self.steps = 0
        self.busy_seconds = 0.0  # simulated GPU time, scaled

    def _num_running(self) -> float:
        return float(len(self.scheduler.running) + self.scheduler.num_parked)

    def _num_waiting(self) -> float:
        return float(self.scheduler.num_waiting)

    def submit(self, request: EngineRequest) -> TokenStream:
        stream = TokenStream(len(request.token_ids))
        seq = Sequence(
            f"r{id(stream):x}", list(request.token_ids), request.max_tokens, request.priority, request.cache_salt
        )
        seq.stall_at = request.stall_at
        stream.arrival = self.clock.now()
        seq.user = _Timing(stream, stream.arrival)
        self._by_stream[stream] = seq
        self.scheduler.add(seq)
        self._waker.poke()
        return stream

    def abort(self, stream: TokenStream) -> None:
        seq = self._by_stream.pop(stream, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        self._finished(stream, FinishReason.ABORT, seq.num_prompt_tokens)
        self._waker.poke()  # freed blocks may unblock a waiting request

    async def run(self) -> None:
        deadline: float | None = None
        while True:
            if not self.scheduler.has_work():
                await self._waker.sleep(None)
                deadline = None
                continue
            plan = self.scheduler.schedule()
            if not plan.scheduled:
                await self._waker.sleep(None)  # blocked on memory; an abort or finish will poke
                continue
            duration = self.cost.step_seconds(plan.shape) * self.time_scale
            now = self.clock.now()
            start = deadline if deadline is not None and deadline >= now - MAX_CATCH_UP_S else now
            deadline = start + duration
            await self._waker.sleep(deadline)
            while self.clock.now() < deadline:  # poked early by a new arrival: keep waiting
                await self._waker.sleep(deadline)
            self._record_lag(deadline)
            self._account(plan.preempted, plan.prefix_queries, plan.prefix_hits, duration)
            self.scheduler.complete(plan, self._on_token)

    def _account(self, preempted: int, queries: int, hits: int, duration: float) -> None:
        self.steps += 1
        self.busy_seconds += duration
        if preempted:
            self.metrics.preemptions.inc(preempted)
        if queries:
            self.metrics.prefix_queries.inc(queries)
            self.metrics.prefix_hits.inc(hits)

    def _on_token(self, seq: Sequence) -> None:
        timing = seq.user
        assert isinstance(timing, _Timing)
        stream = timing.stream
        stream.cached_tokens = max(0, seq.num_cached_tokens)
        if seq.num_output > stream.num_tokens:
            self._emit(timing, seq.num_output - 1, self.clock.now())
        if seq.num_output >= seq.max_tokens:
            self._by_stream.pop(stream, None)
            reason = FinishReason.LENGTH if seq.max_tokens else FinishReason.STOP
            self._finished(stream, reason, seq.num_prompt_tokens)


class _FixedRequest:
    __slots__ = ("blocks", "hashes", "max_tokens", "prompt_tokens", "stall_at", "timing", "token_ids")

    def __init__(self, timing: _Timing, max_tokens: int, prompt_tokens: int, stall_at: int | None = None) -> None:
        self.timing = timing
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.stall_at = stall_at
        self.blocks: list[int] = []
        self.hashes: list[BlockHash] = []
        self.token_ids: list[int] = []


class FixedEngine(_EngineBase):
    """Constant TTFT and inter-token delay per request (see the module docstring)."""

    def __init__(
        self,
        profile: Profile,
        *,
        model_name: str,
        index: int = 0,
        time_scale: float = 1.0,
        clock: Clock | None = None,
        hashing: BlockHashing | None = None,
        output_id: Callable[[int], int] = output_token_id,
    ) -> None:
        super().__init__(
            profile,
            model_name=model_name,
            index=index,
            time_scale=time_scale,
            clock=clock or MonotonicClock(),
            hashing=hashing,
            output_id=output_id,
        )
        self._due: list[tuple[float, int, _FixedRequest]] = []
        self._active: dict[TokenStream, _FixedRequest] = {}
        self._order = itertools.count()

    def _num_running(self) -> float:
        return float(len(self._active))

    def submit(self, request: EngineRequest) -> TokenStream:
        now = self.clock.now()
        stream = TokenStream(len(request.token_ids))
        stream.arrival = now
        req = _FixedRequest(_Timing(stream, now), request.max_tokens, len(request.token_ids), request.stall_at)
        stream.cached_tokens = self._cache_prompt(req, request) * BLOCK_SIZE
        self._active[stream] = req
        heapq.heappush(self._due, (now + self.profile.ttft_s * self.time_scale, next(self._order), req))
        self._waker.poke()
        return stream

    def abort(self, stream: TokenStream) -> None:
        req = self._active.pop(stream, None)
        if req is not None:
            self._release(req)
            self._finished(stream, FinishReason.ABORT, req.prompt_tokens)

    async def run(self) -> None:
        while True:
            while self._due and self._due[0][2].timing.stream not in self._active:
                heapq.heappop(self._due)  # aborted
            if not self._due:
                await self._waker.sleep(None)
                continue
            deadline = self._due[0][0]
            if self.clock.now() < deadline:
                await self._waker.sleep(deadline)
                continue
            self._record_lag(deadline)
            _, _, req = heapq.heappop(self._due)
            self._step(req, deadline)

    def _step(self, req: _FixedRequest, deadline: float) -> None:
        stream = req.timing.stream
        if req.stall_at is not None and stream.num_tokens >= req.stall_at:
            return  # stalled: stays active with its blocks until aborted
        if req.max_tokens:
            self._emit(req.timing, stream.num_tokens, self.clock.now())
        if stream.num_tokens >= req.max_tokens:
            self._active.pop(stream, None)
            self._release(req)
            reason = FinishReason.LENGTH if req.max_tokens else FinishReason.STOP
            self._finished(stream, reason, req.prompt_tokens)
            return
        next_due = deadline + self.profile.itl_s * self.time_scale
        heapq.heappush(self._due, (next_due, next(self._order), req))

    def _cache_prompt(self, req: _FixedRequest, request: EngineRequest) -> int:
        """Hold the prompt's blocks (the cached ones shared); the number of blocks found cached."""
        tokens = req.token_ids = request.token_ids
        req.hashes = block_chain(self.kv.hashing, tokens, len(tokens) // BLOCK_SIZE, request.cache_salt)
        hit = self.kv.lookup(req.hashes[: (len(tokens) - 1) // BLOCK_SIZE])
        self.kv.acquire(hit)
        fresh = self.kv.allocate(len(req.hashes) - len(hit)) or []
        req.blocks = hit + fresh
        self.metrics.prefix_queries.inc(len(tokens))
        self.metrics.prefix_hits.inc(len(hit) * BLOCK_SIZE)
        return len(hit)

    def _release(self, req: _FixedRequest) -> None:
        parents = [None, *req.hashes]  # vLLM's parent_block_hash: None at a chain's start
        for i, (block, block_hash) in enumerate(zip(req.blocks, req.hashes, strict=False)):
            self.kv.commit(block, block_hash, parents[i], req.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        self.kv.release(req.blocks)
        req.blocks = []


def build_engine(
    profile: Profile,
    *,
    model_name: str,
    index: int = 0,
    time_scale: float = 1.0,
    clock: Clock | None = None,
    hashing: BlockHashing | None = None,
    output_id: Callable[[int], int] = output_token_id,
) -> Engine:
    """The engine for a ROOFLINE or FIXED profile, keying its blocks by ``hashing`` (the
    simulator's own chain when None) and generating ``output_id``'s ids."""
    from loadtests.sim.profiles import ProfileKind

    kinds: dict[ProfileKind, type[FixedEngine | BatchingEngine]] = {
        ProfileKind.FIXED: FixedEngine,
        ProfileKind.ROOFLINE: BatchingEngine,
    }
    kind = kinds.get(profile.kind)
    if kind is not None:
        return kind(
            profile,
            model_name=model_name,
            index=index,
            time_scale=time_scale,
            clock=clock,
            hashing=hashing,
            output_id=output_id,
        )
    raise ValueError(f"profile {profile.name!r} has no engine (kind {profile.kind.value})")
