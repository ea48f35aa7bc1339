"""Continuous-batching scheduler, after vLLM V1's unified scheduler.

Each call to `schedule()` builds one engine step under two limits: at most ``max_num_seqs``
running sequences and ``max_num_batched_tokens`` tokens. Running sequences go first (one token
each when decoding, the rest of their prompt in chunks when prefilling); waiting sequences are
then admitted in priority order — lower ``priority`` first, FIFO among equals, as vLLM's
``--scheduling-policy priority`` — with their cached prefix blocks skipped.

When a running sequence needs a block and none is free, the lowest-priority running sequence
(the last admitted among equals) is preempted: its blocks are released and it goes back to the
waiting queue to be recomputed (vLLM V1's only preemption mode). No waiting sequence is admitted
in a step that preempted.

A sequence with ``stall_at`` (an injected fault, ``faults.py``) is parked once it has produced
that many tokens: it leaves the running list but keeps its blocks and its seat among the
``max_num_seqs``, and gets no further steps until it is aborted.

`complete()` applies a finished step: it advances the computed tokens, publishes full blocks to
the prefix cache and samples one token for every sequence whose tokens are all computed.

With a ``SlotTable`` (llama.cpp's slots, ``kvcache.CacheScope``) the block pool still holds the
running sequences' KV, but no block is ever published to its hash index: a new sequence takes
a slot (``max_num_seqs`` of them) and reuses only that slot's common prefix with its prompt; the
slot keeps the sequence's computed tokens when it leaves (finished, aborted or preempted).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtests.sim.costmodel import StepShape
from loadtests.sim.kvcache import BlockHash, KVCache, SlotTable, block_chain, salt_root
from loadtests.sim.tokenizer import output_token_id


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # stalled by an injected fault: keeps its blocks, gets no more steps
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine: its tokens, progress and blocks (mutable, engine-owned)."""

    req_id: str
    token_ids: list[int]
    max_tokens: int  # 0: prefill only (embeddings)
    priority: int = 0
    cache_salt: str | None = None
    num_prompt_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    num_cached_tokens: int = -1  # prefix hit at first admission; -1 until admitted
    status: Status = Status.WAITING
    arrival: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_committed: int = 0  # blocks published to the prefix cache
    user: object = None  # the engine's per-request handle
    stall_at: int | None = None  # injected stall: park once this many tokens are out
    slot: int = -1  # the slot it runs in (slot-scoped caches only)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The batch of one step: (sequence, tokens to compute) pairs and the step's cost shape."""

    scheduled: list[tuple[Sequence, int]]
    shape: StepShape
    preempted: int
    prefix_queries: int  # prompt tokens of newly admitted sequences
    prefix_hits: int  # of which found in the prefix cache


TokenCallback = Callable[[Sequence], None]


class Scheduler:
    """Owns the waiting heap and the running list; see the module docstring for the policy.

    Blocks are keyed by ``kv.hashing`` (the prompt's full blocks hashed once, at ``add``; each
    later block once, when it fills); ``output_id(i)`` is the ``i``-th generated token's id.
    """

    def __init__(
        self,
        kv: KVCache,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        slots: SlotTable | None = None,
        output_id: Callable[[int], int] = output_token_id,
    ) -> None:
        self.kv = kv
        self.slots = slots
        self.output_id = output_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._num_waiting = 0
        self.num_parked = 0
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        full = len(seq.token_ids) // self.kv.block_size
        seq.block_hashes = block_chain(self.kv.hashing, seq.token_ids, full, seq.cache_salt)
        self._push_waiting(seq)

    def abort(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.PARKED:
            self.num_parked -= 1
        elif seq.status is Status.WAITING:
            self._num_waiting -= 1  # lazily dropped from the heap
        self._finish(seq)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = 0
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            ok, evicted = self._grow(seq, seq.num_computed + n)
            preempted += evicted
            if ok:
                scheduled.append((seq, n))
                budget -= n
        queries = hits = 0
        if not preempted:
            while self._waiting and budget > 0 and len(self.running) + self.num_parked < self.max_num_seqs:
                admitted = self._admit(budget)
                if admitted is None:
                    break
                seq, n, cached = admitted
                scheduled.append((seq, n))
                budget -= n
                queries += len(seq.token_ids)
                hits += cached
        context = sum(seq.num_computed + n for seq, n in scheduled)
        shape = StepShape(self.max_num_batched_tokens - budget, context, len(scheduled))
        return StepPlan(scheduled, shape, preempted, queries, hits)

    def complete(self, plan: StepPlan, on_token: TokenCallback) -> None:
        """Apply a finished step; `on_token` sees each sequence that sampled a token."""
        bs = self.kv.block_size
        for seq, n in plan.scheduled:
            if seq.status is not Status.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.num_computed += n
            full = seq.num_computed // bs
            if full > seq.num_committed:
                self._commit(seq, full)
            if seq.num_computed < len(seq.token_ids):
                continue  # still prefilling
            if seq.stall_at is not None and seq.num_output >= seq.stall_at:
                self._park(seq)
                continue
            if seq.num_output < seq.max_tokens:
                seq.token_ids.append(self.output_id(seq.num_output))
                seq.num_output += 1
            on_token(seq)
            if seq.num_output >= seq.max_tokens:
                self.running.remove(seq)
                self._finish(seq)

    # -- internals ---------------------------------------------------------------------------

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _park(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = Status.PARKED
        self.num_parked += 1

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self._leave_slot(seq)
        self.kv.release(seq.blocks)
        seq.blocks = []

    def _leave_slot(self, seq: Sequence) -> None:
        if self.slots is None or seq.slot < 0:
            return
        computed = seq.num_computed
        self._extend_hashes(seq, computed // self.kv.block_size)
        self.slots.release(seq.slot, salt_root(seq.cache_salt), seq.token_ids[:computed], seq.block_hashes)
        seq.slot = -1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.block_size)

    def _grow(self, seq: Sequence, tokens: int) -> tuple[bool, int]:
        """Give `seq` blocks for `tokens`, preempting from the back; (scheduled?, preemptions)."""
        need = self._blocks_for(tokens) - len(seq.blocks)
        preempted = 0
        while need > 0:
            blocks = self.kv.allocate(need)
            if blocks is not None:
                seq.blocks.extend(blocks)
                break
            victim = self.running[-1]
            self._preempt(victim)
            preempted += 1
            if victim is seq:
                return False, preempted
        return True, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._leave_slot(seq)
        self.kv.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_committed = 0
        self._push_waiting(seq)

    def _admit(self, budget: int) -> tuple[Sequence, int, int] | None:
        while self._waiting and self._waiting[0][2].status is not Status.WAITING:
            heapq.heappop(self._waiting)  # aborted while waiting
        if not self._waiting:
            return None
        seq = self._waiting[0][2]
        bs = self.kv.block_size
        self._extend_hashes(seq, len(seq.token_ids) // bs)
        if self.slots is not None:
            return self._admit_to_slot(seq, budget)
        max_hit_blocks = (len(seq.token_ids) - 1) // bs  # always compute at least one token
        cached_blocks = self.kv.lookup(seq.block_hashes[:max_hit_blocks])
        cached = len(cached_blocks) * bs
        n = min(len(seq.token_ids) - cached, budget)
        self.kv.acquire(cached_blocks)
        fresh = self.kv.allocate(self._blocks_for(cached + n) - len(cached_blocks))
        if fresh is None:
            self.kv.release(cached_blocks)
            return None
        self._start(seq, cached_blocks + fresh, cached, len(cached_blocks))
        return seq, n, cached

    def _admit_to_slot(self, seq: Sequence, budget: int) -> tuple[Sequence, int, int] | None:
        """Seat ``seq`` in the slot ``SlotTable`` chooses; its blocks are all fresh (nothing is shared)."""
        assert self.slots is not None
        salt = salt_root(seq.cache_salt)
        slot, lcp = self.slots.best(salt, seq.token_ids, seq.block_hashes)
        cached = min(lcp, len(seq.token_ids) - 1)
        n = min(len(seq.token_ids) - cached, budget)
        if slot < 0:
            return None
        blocks = self.kv.allocate(self._blocks_for(cached + n))
        if blocks is None:
            return None
        seq.slot, _ = self.slots.take(salt, seq.token_ids, seq.block_hashes)
        self._start(seq, blocks, cached, cached // self.kv.block_size)
        return seq, n, cached

    def _start(self, seq: Sequence, blocks: list[int], cached: int, committed: int) -> None:
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        seq.blocks = blocks
        seq.num_computed = cached
        seq.num_committed = committed
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = cached
        seq.status = Status.RUNNING
        self._insert_running(seq)

    def _insert_running(self, seq: Sequence) -> None:
        key = (seq.priority, seq.arrival)
        i = len(self.running)
        while i > 0 and (self.running[i - 1].priority, self.running[i - 1].arrival) > key:
            i -= 1
        self.running.insert(i, seq)

    def _extend_hashes(self, seq: Sequence, full_blocks: int) -> None:
        if full_blocks > len(seq.block_hashes):
            self.kv.hashing.extend(seq.block_hashes, seq.token_ids, full_blocks, seq.cache_salt)

    def _commit(self, seq: Sequence, full: int) -> None:
        if self.slots is not None:  # a slot's tokens are its own: nothing goes to a shared index
            seq.num_committed = full
            return
        self._extend_hashes(seq, full)
        bs = self.kv.block_size
        for i in range(seq.num_committed, min(full, len(seq.blocks))):
            parent = seq.block_hashes[i - 1] if i else None  # vLLM's parent_block_hash: None at a chain's start
            self.kv.commit(seq.blocks[i], seq.block_hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])
        seq.num_committed = full
