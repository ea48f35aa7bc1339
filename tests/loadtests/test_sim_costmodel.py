"""Roofline arithmetic and calibration against public vLLM measurements."""

from __future__ import annotations

import pytest

from loadtests.sim.costmodel import RooflineCostModel, StepShape
from loadtests.sim.profiles import CALIBRATION, CalibrationPoint, get_profile


def test_decode_step_reads_weights_and_kv_once_at_effective_bandwidth() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    model = RooflineCostModel(profile)
    context = 4096
    expected_bytes = 8.03e9 * 2 + context * (2 * 32 * 8 * 128 * 2)
    expected = expected_bytes / (3.35e12 * 0.8) + 0.001
    assert model.step_seconds(StepShape(tokens=8, context_tokens=context, num_seqs=8)) == pytest.approx(expected)


def test_prefill_step_costs_two_flops_per_parameter_per_token_at_mfu() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    model = RooflineCostModel(profile)
    expected = 2 * 8.03e9 * 4096 / (989e12 * 0.4) + 0.001
    assert model.step_seconds(StepShape(tokens=4096, context_tokens=4096, num_seqs=1)) == pytest.approx(expected)


def test_tensor_parallelism_divides_both_roofs_by_tp_times_efficiency() -> None:
    profile = get_profile("llama-3.1-70b-h100x4")
    model = RooflineCostModel(profile)
    assert model.compute_seconds(1000) == pytest.approx(2 * 70.6e9 * 1000 / (989e12 * 4 * 0.85 * 0.4))
    assert model.memory_seconds(0) == pytest.approx(70.6e9 * 2 / (3.35e12 * 4 * 0.85 * 0.8))


@pytest.mark.parametrize(
    ("tokens", "bound"),
    [(1, "memory"), (8192, "compute")],
    ids=["a single decode token is memory bound", "a full prefill chunk is compute bound"],
)
def test_a_mixed_step_costs_the_larger_roof_not_the_sum(tokens: int, bound: str) -> None:
    model = RooflineCostModel(get_profile("llama-3.1-8b-h100"))
    compute, memory = model.compute_seconds(tokens), model.memory_seconds(tokens)
    step = model.step_seconds(StepShape(tokens, tokens, 1))
    assert step == pytest.approx(max(compute, memory) + 0.001)
    assert (compute > memory) == (bound == "compute")


def test_an_empty_step_costs_nothing() -> None:
    assert RooflineCostModel(get_profile("llama-3.1-8b-h100")).step_seconds(StepShape(0, 0, 0)) == 0.0


@pytest.mark.parametrize(
    ("profile", "blocks_between"),
    [
        ("llama-3.1-8b-h100", (20_000, 30_000)),
        ("llama-3.1-70b-h100x4", (20_000, 35_000)),
        ("llama-3.2-1b-l4", (30_000, 45_000)),
    ],
    ids=["8B on one H100 keeps ~53 GB for KV", "70B on four H100 keeps ~140 GB", "1B on an L4 keeps ~17 GB"],
)
def test_kv_cache_is_gpu_memory_times_utilisation_minus_weights(profile: str, blocks_between: tuple[int, int]) -> None:
    low, high = blocks_between
    assert low < get_profile(profile).num_kv_blocks < high


@pytest.mark.parametrize(
    "point", CALIBRATION, ids=[f"{p.profile} matches its cited TTFT and TPOT" for p in CALIBRATION]
)
def test_profile_stays_within_30_percent_of_the_cited_measurement(point: CalibrationPoint) -> None:
    model = RooflineCostModel(get_profile(point.profile))
    ttft_ms = 1000 * model.step_seconds(StepShape(point.prompt_tokens, point.prompt_tokens, point.batch))
    decode = StepShape(point.batch, point.batch * point.decode_context, point.batch)
    tpot_ms = 1000 * model.step_seconds(decode)
    assert ttft_ms == pytest.approx(point.ttft_ms, rel=0.3)
    assert tpot_ms == pytest.approx(point.tpot_ms, rel=0.3)
