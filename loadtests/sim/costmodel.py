"""Roofline cost model: how long one engine step takes on the profile's GPUs.

A vLLM step is one forward pass over every scheduled token: prefill chunks and one token per
decoding request, fused in a single batch. Its time is bounded below by two roofs:

* compute: ``2 × params`` FLOPs per token processed, at ``peak × tp × tp_efficiency × mfu``;
* memory: the weights once plus the KV cache of every scheduled sequence (context read by
  attention), at ``hbm_bandwidth × tp × tp_efficiency × bandwidth_efficiency``.

A mixed step costs ``max(compute, memory) + step_overhead``, not the sum: prefill and decode
tokens share one pass, so the weights are read once for both, and the GPU overlaps memory
traffic with math. A pure decode step is therefore memory-bound and a long prefill chunk is
compute-bound, which is the regime split vLLM's chunked prefill relies on. Attention FLOPs
(∝ context²) are left out: below ~8k tokens of context they add under 10% for these models.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.sim.profiles import Profile


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step processes: tokens computed, KV tokens read, sequences in the batch."""

    tokens: int
    context_tokens: int
    num_seqs: int


class RooflineCostModel:
    """Seconds per step for a ROOFLINE profile (see the module docstring for the formula)."""

    def __init__(self, profile: Profile) -> None:
        gpus = profile.tp * profile.tp_efficiency
        self._flops_per_token = 2.0 * profile.model.params
        self._flops_per_s = profile.gpu.peak_flops * gpus * profile.mfu
        self._bytes_per_s = profile.gpu.hbm_bandwidth * gpus * profile.bandwidth_efficiency
        self._weight_bytes = profile.model.weight_bytes
        self._kv_bytes_per_token = profile.model.kv_bytes_per_token
        self._overhead_s = profile.step_overhead_s

    def compute_seconds(self, tokens: int) -> float:
        return self._flops_per_token * tokens / self._flops_per_s

    def memory_seconds(self, context_tokens: int) -> float:
        return (self._weight_bytes + self._kv_bytes_per_token * context_tokens) / self._bytes_per_s

    def step_seconds(self, shape: StepShape) -> float:
        if shape.tokens <= 0:
            return 0.0
        roof = max(self.compute_seconds(shape.tokens), self.memory_seconds(shape.context_tokens))
        return roof + self._overhead_s
