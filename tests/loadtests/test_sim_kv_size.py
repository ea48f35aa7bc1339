"""The simulator's KV cache size follows vLLM's --gpu-memory-utilization (a routing-bench knob)."""

from __future__ import annotations

import pytest

from loadtests.sim import build_engine_app
from loadtests.sim.profiles import BLOCK_SIZE, get_profile

PROFILE = "llama-3.1-8b-h100"


def test_a_lower_utilisation_leaves_the_kv_cache_what_remains_after_the_weights() -> None:
    default, half = get_profile(PROFILE), get_profile(PROFILE, gpu_memory_utilization=0.5)
    assert default.gpu_memory_utilization == 0.9
    expected = (80e9 * 0.5 - 2e9 - 8.03e9 * 2) // (2 * 32 * 8 * 128 * 2 * BLOCK_SIZE)
    assert half.num_kv_blocks == expected
    assert half.num_kv_blocks * BLOCK_SIZE == 167_376
    assert default.num_kv_blocks > 2 * half.num_kv_blocks


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_a_utilisation_outside_0_1_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        get_profile(PROFILE, gpu_memory_utilization=value)


def test_the_engine_app_sizes_its_cache_from_the_option() -> None:
    assert build_engine_app(PROFILE, gpu_memory_utilization=0.5).max_model_len == 167_376  # the whole cache
    assert build_engine_app(PROFILE).max_model_len == get_profile(PROFILE).num_kv_blocks * BLOCK_SIZE
