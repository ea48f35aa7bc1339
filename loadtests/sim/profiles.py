"""Engine profiles: a model on a GPU, plus the scheduler limits of one vLLM instance.

A profile is the only input of the cost model. Three kinds exist:

* ``ROOFLINE``: step times come from `costmodel.RooflineCostModel` (prefill compute-bound,
  decode bandwidth-bound). The efficiency factors (MFU, bandwidth efficiency, TP efficiency,
  per-step overhead) were calibrated against the public measurements in `CALIBRATION`.
* ``FIXED``: TTFT and inter-token delay are set by options (the gateway demo uses it).
* ``INSTANT``: no simulated time at all; the server answers directly (overhead benchmark).

Usage::

    profile = get_profile("llama-3.1-8b-h100")
    profile.model.weight_bytes  # 16.06e9
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from loadtests.sim.kvcache import CacheScope

BLOCK_SIZE = 16  # tokens per KV block, vLLM's default on CUDA
SIM_MODEL_NAME = "sim-model"  # default served name of the `fixed` and `instant` profiles


class ProfileKind(enum.Enum):
    ROOFLINE = "roofline"
    FIXED = "fixed"
    INSTANT = "instant"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer, enough for FLOP and byte counts."""

    name: str  # the served model name, as on Hugging Face
    params: float  # parameter count
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer, in the weights' dtype (vLLM's default kv-cache dtype)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures of one GPU (dense bf16, no sparsity)."""

    name: str
    peak_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float


@dataclass(frozen=True, slots=True)
class Profile:
    """One engine instance: model, GPUs, efficiency factors and scheduler limits."""

    name: str
    kind: ProfileKind
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1  # tensor-parallel degree (GPUs per engine)
    tp_efficiency: float = 1.0  # fraction of linear TP scaling kept (all-reduce cost)
    mfu: float = 0.4  # model-FLOPs utilisation of prefill
    bandwidth_efficiency: float = 0.8  # achieved / peak HBM bandwidth in decode
    step_overhead_s: float = 0.001  # scheduler + launch + sampling, per step
    gpu_memory_utilization: float = 0.9  # vLLM's --gpu-memory-utilization
    activation_reserve_bytes: float = 2e9  # per GPU: activations, CUDA graphs, allocator slack
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    default_max_tokens: int = 128
    ttft_s: float = 0.05  # FIXED only
    itl_s: float = 0.01  # FIXED only
    cache_scope: CacheScope = CacheScope.POOL  # ROOFLINE only: vLLM's block pool, or llama.cpp's slots
    slot_similarity: float = 0.1  # llama.cpp's --slot-prompt-similarity (slot scopes only)

    @property
    def kv_cache_bytes(self) -> float:
        per_gpu = self.gpu.hbm_bytes * self.gpu_memory_utilization - self.activation_reserve_bytes
        return per_gpu * self.tp - self.model.weight_bytes

    @property
    def num_kv_blocks(self) -> int:
        return max(0, int(self.kv_cache_bytes // (self.model.kv_bytes_per_token * BLOCK_SIZE)))


H100_SXM = GpuSpec("H100-SXM-80GB", peak_flops=989e12, hbm_bandwidth=3.35e12, hbm_bytes=80e9)
L4 = GpuSpec("L4-24GB", peak_flops=121e12, hbm_bandwidth=300e9, hbm_bytes=24e9)

LLAMA_31_8B = ModelSpec("meta-llama/Llama-3.1-8B-Instruct", 8.03e9, layers=32, kv_heads=8, head_dim=128)
LLAMA_31_70B = ModelSpec("meta-llama/Llama-3.1-70B-Instruct", 70.6e9, layers=80, kv_heads=8, head_dim=128)
LLAMA_32_1B = ModelSpec("meta-llama/Llama-3.2-1B-Instruct", 1.24e9, layers=16, kv_heads=8, head_dim=64)
SIM_MODEL = ModelSpec(SIM_MODEL_NAME, 8.03e9, layers=32, kv_heads=8, head_dim=128)


@dataclass(frozen=True, slots=True)
class CalibrationPoint:
    """A public measurement a profile must reproduce within 30% (see tests/loadtests).

    The scenario is a batch of `batch` requests arriving together with `prompt_tokens` prompt
    tokens in total (one prefill step), then decoding together with `decode_context` tokens of
    context on average.
    """

    profile: str
    source: str
    batch: int
    prompt_tokens: int
    decode_context: int
    ttft_ms: float
    tpot_ms: float


# Lambda Labs' vLLM benchmark (vLLM v0.5.4/v0.6 era, multi-step scheduling), "prompt_10": ten
# ShareGPT prompts of 1,369 tokens in total sent at once; ITL arrives in bursts of ten tokens,
# so time per token is the burst gap / 10 (and the reported median TPOT agrees).
_LAMBDA = "https://github.com/LambdaLabsML/vllm-benchmark/blob/main/results/prompt_10/"
CALIBRATION: tuple[CalibrationPoint, ...] = (
    CalibrationPoint(
        "llama-3.1-8b-h100",
        _LAMBDA + "1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json"
        " (median TTFT 62.2 ms, ITL 72.3 ms per 10 tokens, median TPOT 7.56 ms)",
        batch=10,
        prompt_tokens=1369,
        decode_context=300,
        ttft_ms=62.2,
        tpot_ms=7.23,
    ),
    CalibrationPoint(
        "llama-3.1-70b-h100x4",
        _LAMBDA + "4xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp4_len2048.json"
        " (p99 TTFT 141 ms, ITL 175 ms per 10 tokens, median TPOT 18.1 ms)",
        batch=10,
        prompt_tokens=1369,
        decode_context=300,
        ttft_ms=140.6,
        tpot_ms=17.5,
    ),
    # No L4 measurement of a 1B model was found in the searched sources: the L4 profile keeps
    # the H100-calibrated efficiencies and is checked against its own datasheet roofline
    # (2.47 GB / 300 GB/s = 8.3 ms ideal per token; prefill 2·1.24e9·1369 FLOP / 121 TFLOP/s).
    # This point is the datasheet ideal divided by the H100-measured efficiencies.
    CalibrationPoint(
        "llama-3.2-1b-l4",
        "datasheet roofline (NVIDIA L4: 121 TFLOP/s bf16 dense, 300 GB/s) x H100-calibrated efficiency",
        batch=10,
        prompt_tokens=1369,
        decode_context=300,
        ttft_ms=71.0,
        tpot_ms=11.7,
    ),
)


def _builtin() -> dict[str, Profile]:
    roofline = ProfileKind.ROOFLINE
    profiles = (
        Profile("llama-3.1-8b-h100", roofline, LLAMA_31_8B, H100_SXM),
        Profile(
            "llama-3.1-70b-h100x4",
            roofline,
            LLAMA_31_70B,
            H100_SXM,
            tp=4,
            tp_efficiency=0.85,
            step_overhead_s=0.002,
        ),
        Profile(
            "llama-3.2-1b-l4",
            roofline,
            LLAMA_32_1B,
            L4,
            max_num_batched_tokens=2048,
            activation_reserve_bytes=1.5e9,
        ),
        Profile("fixed", ProfileKind.FIXED, SIM_MODEL, H100_SXM),
        Profile("instant", ProfileKind.INSTANT, SIM_MODEL, H100_SXM),
    )
    return {p.name: p for p in profiles}


def profile_names() -> list[str]:
    return sorted(_builtin())


def get_profile(
    name: str,
    *,
    ttft_ms: float | None = None,
    itl_ms: float | None = None,
    gpu_memory_utilization: float | None = None,
    cache_scope: CacheScope | str | None = None,
    max_num_seqs: int | None = None,
) -> Profile:
    """Look a profile up by name; `ttft_ms`/`itl_ms` override the `fixed` profile's delays.

    `cache_scope` chooses what the prefix cache holds (``kvcache.CacheScope``: ``slots`` is a
    llama.cpp server with ``--cache-ram 0``) and `max_num_seqs` the running sequences (vLLM's
    ``--max-num-seqs``, llama.cpp's ``--parallel`` slots); only engines that batch (ROOFLINE)
    model slots.

    `gpu_memory_utilization` overrides vLLM's ``--gpu-memory-utilization`` and so the KV cache
    size: a GPU shared with another process, or a benchmark that must fill the cache in a
    short run, sets it lower than the default 0.9.
    """
    try:
        profile = _builtin()[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(profile_names())}") from None
    if ttft_ms is not None:
        profile = replace(profile, ttft_s=ttft_ms / 1000.0)
    if itl_ms is not None:
        profile = replace(profile, itl_s=itl_ms / 1000.0)
    if gpu_memory_utilization is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        profile = replace(profile, gpu_memory_utilization=gpu_memory_utilization)
    if max_num_seqs is not None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        profile = replace(profile, max_num_seqs=max_num_seqs)
    if cache_scope is not None:
        scope = CacheScope(cache_scope)
        if scope is not CacheScope.POOL and profile.kind is not ProfileKind.ROOFLINE:
            raise ValueError(f"cache scope {scope.value!r} needs a batching (roofline) profile, not {name!r}")
        profile = replace(profile, cache_scope=scope)
    return profile
