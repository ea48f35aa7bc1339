"""The capacity plan's search, against an in-process stand-in for the replay.

A unit test of the search itself: the stand-in's attainment is a known function of the fleet
size, the repeat and the policy file it is handed, so the answer is known. The real replay is
tested in ``test_replay.py``; the plan end to end on real processes belongs to the integration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.whatif.model import EngineLoad, ReplayRequest, SideRun, StageSettings, Trace
from loadtests.whatif.plan import (
    AS_WRITTEN,
    QUEUE_VARIANTS,
    PlanResult,
    QueueVariant,
    Replayer,
    fleet_cost_per_hour,
    plan,
    with_queue_variant,
)
from tests.whatif.test_compare import record

DEMO_POLICY = Path(__file__).resolve().parents[2] / "policies" / "demo.yaml"
DEMO_PRICE = 2.49  # sim-a, the model's first backend: one GPU at $2.49 an hour
TARGETS = {"interactive": 0.99, "batch": 0.9}
SETTINGS = StageSettings(profile="h100-llama8b", speed=4.0)
REQUESTS_PER_CLASS = 100
ELAPSED_S = 360.0

Attainment = Callable[[int, int, Mapping[str, Any]], Mapping[str, float]]
"""(engines, repeat, policy document) to each class's attainment."""


@dataclass
class ScriptedReplayer:
    """Stands in for ``replay_side``: 100 requests per class, of which ``attainment(...)`` met their SLO."""

    attainment: Attainment
    calls: list[tuple[int, str, int]] = field(default_factory=list)
    """(engines, side, repeat) of every run, in order."""

    async def __call__(
        self,
        trace: Trace,
        policy: Path,
        settings: StageSettings,
        *,
        side: str,
        repeat: int,
        work_dir: Path,
        port_base: int,
    ) -> SideRun:
        assert settings.engines is not None, "the plan sets the fleet size"
        assert (settings.speed, settings.profile) == (SETTINGS.speed, SETTINGS.profile)
        self.calls.append((settings.engines, side, repeat))
        shares = self.attainment(settings.engines, repeat, policy_document(policy))
        records = [
            record(1000 * c + i, class_name=name, slo_met=i < round(share * REQUESTS_PER_CLASS))
            for c, (name, share) in enumerate(shares.items())
            for i in range(REQUESTS_PER_CLASS)
        ]
        engines = [EngineLoad(f"sim-a-{i}", 10, 0.5, 1.0, 0.0, 1, DEMO_PRICE) for i in range(settings.engines)]
        return SideRun(side, repeat, tuple(records), ELAPSED_S, tuple(engines))

    @property
    def sizes(self) -> list[int]:
        """Fleet sizes tried, in order, each once."""
        return list(dict.fromkeys(engines for engines, _, _ in self.calls))


def policy_document(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return document


def needs(engines_needed: int) -> Attainment:
    """Every class meets its target from ``engines_needed`` engines on, and only then."""

    def attainment(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        share = 1.0 if engines >= engines_needed else 0.5 + 0.4 * engines / engines_needed
        return {"interactive": share, "batch": share}

    return attainment


def passing_at(sizes: Callable[[int], bool]) -> Attainment:
    def attainment(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        return {"interactive": 1.0 if sizes(engines) else 0.5, "batch": 1.0}

    return attainment


TRACE = Trace(
    requests=(ReplayRequest(0.0, "acme", "interactive", "m", True, 10, 4, 64, ()),),
    source="minimal",
)


async def run_plan(
    replayer: Replayer,
    tmp_path: Path,
    *,
    max_engines: int = 16,
    variants: tuple[QueueVariant, ...] = (AS_WRITTEN,),
    targets: Mapping[str, float] = TARGETS,
    repeats: int = 2,
) -> PlanResult:
    return await plan(
        TRACE,
        DEMO_POLICY,
        SETTINGS,
        targets,
        replayer,
        work_dir=tmp_path / "runs",
        port_base=19400,
        max_engines=max_engines,
        queue_variants=variants,
        repeats=repeats,
    )


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 8, 11, 16], ids=lambda n: f"needing {n} engines finds {n}")
async def test_the_search_finds_the_smallest_passing_size(needed: int, tmp_path: Path) -> None:
    replayer = ScriptedReplayer(needs(needed))
    result = await run_plan(replayer, tmp_path)
    assert result.engines == needed
    assert result.base_engines == needed
    assert result.monotone
    assert result.variant == AS_WRITTEN
    tried = {t.engines: t.passed for t in result.trials}
    assert tried[needed] is True
    if needed > 1:
        assert tried[needed - 1] is False, "the size below the answer was tried and failed"
    assert all(passed == (size >= needed) for size, passed in tried.items())
    assert len(tried) <= 2 * math.ceil(math.log2(16)) + 2, "exponential then binary: logarithmically many sizes"


async def test_the_search_doubles_then_bisects(tmp_path: Path) -> None:
    replayer = ScriptedReplayer(needs(5))
    await run_plan(replayer, tmp_path)
    assert replayer.sizes == [1, 2, 4, 8, 6, 5]
    assert replayer.calls[:3] == [(1, "engines=1", 0), (2, "engines=2", 0), (4, "engines=4", 0)]


async def test_a_failing_repeat_ends_its_trial_and_a_passing_one_runs_every_repeat(tmp_path: Path) -> None:
    replayer = ScriptedReplayer(needs(4))
    result = await run_plan(replayer, tmp_path, repeats=3)
    runs = {t.engines: len(t.runs) for t in result.trials}
    assert (runs[1], runs[2], runs[3]) == (1, 1, 1)
    assert runs[4] == 3
    assert [repeat for engines, _, repeat in replayer.calls if engines == 4] == [0, 1, 2]


async def test_a_size_passes_only_if_its_worst_repeat_passes(tmp_path: Path) -> None:
    def lucky_once(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        passes = engines >= 4 or (engines == 3 and repeat == 0)
        return {"interactive": 1.0 if passes else 0.98, "batch": 1.0}

    result = await run_plan(ScriptedReplayer(lucky_once), tmp_path)
    assert result.engines == 4
    three = next(t for t in result.trials if t.engines == 3)
    assert not three.passed
    assert three.attainment["interactive"] == (1.0, 0.98)
    assert three.margin == pytest.approx(0.98 - 0.99)


async def test_no_size_up_to_the_maximum_gives_no_answer(tmp_path: Path) -> None:
    replayer = ScriptedReplayer(needs(40))
    result = await run_plan(replayer, tmp_path, max_engines=10)
    assert (result.engines, result.chosen, result.base_engines) == (None, None, None)
    assert replayer.sizes == [1, 2, 4, 8, 10]
    assert result.cost_per_hour is None
    assert result.cost_per_goodput_request.median is None


async def test_a_size_whose_larger_neighbour_fails_is_not_the_answer(tmp_path: Path) -> None:
    replayer = ScriptedReplayer(passing_at(lambda n: n == 4 or n >= 6))
    result = await run_plan(replayer, tmp_path)
    assert replayer.sizes == [1, 2, 4, 3, 5, 6, 7]
    assert result.engines == 6
    assert not result.monotone


async def test_a_queue_variant_that_meets_the_targets_with_one_engine_fewer_wins(tmp_path: Path) -> None:
    def shedding_helps(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        classes = policy["classes"]
        sheds = all(c.get("queue", {}).get("max_wait_s") == c["slo"]["ttft_ms"] / 1000 for c in classes.values())
        return needs(5)(engines + 1 if sheds else engines, repeat, policy)

    replayer = ScriptedReplayer(shedding_helps)
    result = await run_plan(replayer, tmp_path, variants=QUEUE_VARIANTS)
    assert result.base_engines == 5
    assert result.engines == 4
    assert result.variant == QueueVariant("wait-ttft", wait_ttft_factor=1.0)
    assert {t.variant.name for t in result.trials if t.engines == 3} == {v.name for v in QUEUE_VARIANTS}
    assert not any(t.passed for t in result.trials if t.engines == 3), "one engine fewer, no variant passes"
    chosen = policy_document(result.chosen.policy) if result.chosen else {}
    assert chosen["classes"]["interactive"]["queue"]["max_wait_s"] == pytest.approx(0.5)
    assert chosen["classes"]["batch"]["queue"]["max_wait_s"] == pytest.approx(2.0)
    assert chosen["tenants"] == yaml.safe_load(DEMO_POLICY.read_text(encoding="utf-8"))["tenants"]


async def test_at_the_answer_the_variant_with_the_largest_margin_is_chosen(tmp_path: Path) -> None:
    def deep_queues_help(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        deep = policy["classes"]["interactive"]["queue"]["max_depth"] > 256
        share = (0.999 if deep else 0.992) if engines >= 3 else 0.5
        return {"interactive": share, "batch": 1.0}

    result = await run_plan(ScriptedReplayer(deep_queues_help), tmp_path, variants=QUEUE_VARIANTS)
    assert result.engines == 3
    assert result.variant == QueueVariant("deep", depth_factor=4.0)
    same_margin = await run_plan(ScriptedReplayer(needs(3)), tmp_path / "ties", variants=QUEUE_VARIANTS)
    assert same_margin.variant == AS_WRITTEN, "the policy as written wins a tie"


async def test_cost_at_the_chosen_size_comes_from_the_policys_backend(tmp_path: Path) -> None:
    result = await run_plan(ScriptedReplayer(needs(3)), tmp_path)
    assert result.cost_per_engine_hour == pytest.approx(DEMO_PRICE)
    assert result.cost_per_hour == pytest.approx(3 * DEMO_PRICE)
    goodput_requests = 2 * REQUESTS_PER_CLASS
    expected = 3 * DEMO_PRICE * ELAPSED_S / 3600 / goodput_requests
    assert result.cost_per_goodput_request.values == pytest.approx((expected, expected))


def test_fleet_cost_counts_each_models_first_backend_times_its_gpus() -> None:
    unpriced: dict[str, Any] = {"name": "b", "models": ["small", "large"], "gpus": 4}
    priced = unpriced | {"price_per_gpu_hour": 3.0}
    small = {"name": "a", "models": ["small"], "price_per_gpu_hour": 2.0}
    models = [{"name": "small"}, {"name": "large"}]
    assert fleet_cost_per_hour({"models": models, "backends": [small, priced]}, 2) == pytest.approx(
        2 * 2.0 + 2 * 4 * 3.0
    )
    assert fleet_cost_per_hour({"models": models, "backends": [small, unpriced]}, 2) is None


def test_queue_variants_rewrite_every_class_and_nothing_else() -> None:
    document = yaml.safe_load(DEMO_POLICY.read_text(encoding="utf-8"))
    document["classes"]["batch"]["queue"]["max_depth"] = 0
    shallow = with_queue_variant(document, QueueVariant("shallow", depth_factor=0.25))
    assert shallow["classes"]["interactive"]["queue"] == {"max_depth": 64}
    assert shallow["classes"]["batch"]["queue"]["max_depth"] == 0, "a queue of depth zero stays off"
    half = with_queue_variant(document, QueueVariant("half", wait_ttft_factor=0.5))
    assert half["classes"]["interactive"]["queue"]["max_wait_s"] == pytest.approx(0.25)
    assert half["backends"] == document["backends"]
    assert document["classes"]["interactive"]["queue"] == {"max_depth": 256}, "the original is untouched"


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ({"premium": 0.9}, "no class premium"),
        ({"interactive": 1.5}, "within"),
        ({}, "at least one class"),
    ],
    ids=["a class the policy lacks", "a target above one", "no target at all"],
)
async def test_a_plan_that_cannot_mean_anything_is_refused_before_any_replay(
    targets: Mapping[str, float], message: str, tmp_path: Path
) -> None:
    replayer = ScriptedReplayer(needs(1))
    with pytest.raises(ValueError, match=message):
        await run_plan(replayer, tmp_path, targets=targets)
    assert replayer.calls == []


async def test_a_target_class_absent_from_the_replay_is_an_error(tmp_path: Path) -> None:
    def interactive_only(engines: int, repeat: int, policy: Mapping[str, Any]) -> Mapping[str, float]:
        return {"interactive": 1.0}

    with pytest.raises(ValueError, match="'batch' has no requests"):
        await run_plan(ScriptedReplayer(interactive_only), tmp_path)
