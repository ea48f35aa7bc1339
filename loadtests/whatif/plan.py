"""Capacity planning: the smallest fleet, and its queue settings, that meets every class's SLO
attainment target on a trace (``inference-gateway whatif plan``).

The search, written before the code:

1. A *trial* is one fleet size n with one queue variant v: the trace replayed ``repeats`` times
   through the policy with v applied, on n engines per served model. It *passes* when in every
   repeat every class named in the targets reaches its attainment target: the worst repeat
   decides, so a size that passes once by luck does not count. A failing repeat ends its trial
   (the repeats left could not make it pass).
2. With the policy's queues as written: sizes 1, 2, 4, 8... (the last capped at ``max_engines``)
   until one passes, then a binary search between the last failing and the first passing size.
   That is valid because attainment grows with engines: the same arrivals spread over more
   engines meet shorter queues and smaller batches, so when a size passes every larger one does
   too, up to run-to-run noise.
3. Noise can break that near the threshold, so the size found is confirmed by the next larger
   one (run unless already tried). If that fails, the search is not monotone there
   (``PlanResult.monotone`` is False, and the report says so) and it goes on upward one engine
   at a time to the next passing size, confirmed the same way: the answer never has a failing
   larger neighbour.
4. Queue settings: from the size found, every queue variant (``QUEUE_VARIANTS``) is tried one
   engine fewer; while one passes there, the search steps down. At the final size every
   variant is run, and the passing one with the largest margin (the worst repeat's attainment
   less its target, lowest over the classes) is chosen; the policy as written wins ties. So at
   the answer's size some variant passes, and one engine fewer none does.

If no size up to ``max_engines`` passes with any variant there is no answer (``engines`` None).
Cost per hour: ``engines × gpus × price_per_gpu_hour`` of each served model's first backend in
the policy (the backend a stage of n engines copies); per goodput request: that cost over the
replay's elapsed trace time, divided by the requests that met their SLO (``compare.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from gateway.policy.model import QueuePolicy
from loadtests.whatif.compare import Spread, cost_per_goodput_request
from loadtests.whatif.model import SideRun, StageSettings, Trace

DEFAULT_MAX_ENGINES = 16


class Replayer(Protocol):
    """Runs one repeat of a trace through one policy on a fleet of simulated engines and returns
    what it measured, in trace time (``loadtests.whatif.replay.replay_side`` is the real one)."""

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
    ) -> SideRun: ...


@dataclass(frozen=True, slots=True)
class QueueVariant:
    """A change to every class's queue: ``max_depth`` times ``depth_factor`` (a non-zero depth
    stays at least 1), and ``max_wait_s`` set to ``wait_ttft_factor`` times the class's TTFT
    objective (None: as written). Usage: ``QueueVariant("shallow", depth_factor=0.25)``."""

    name: str
    depth_factor: float = 1.0
    wait_ttft_factor: float | None = None


AS_WRITTEN = QueueVariant("as-written")
QUEUE_VARIANTS: tuple[QueueVariant, ...] = (
    AS_WRITTEN,
    # Sheds a burst sooner: the requests it keeps wait less.
    QueueVariant("shallow", depth_factor=0.25),
    # Absorbs a burst instead of refusing it (a refusal counts as a miss).
    QueueVariant("deep", depth_factor=4.0),
    # Refuses a request once it has waited its class's whole TTFT objective: it would miss anyway,
    # and serving it late takes engine time from requests that can still make theirs.
    QueueVariant("wait-ttft", wait_ttft_factor=1.0),
    # The same, leaving the engine half the objective for the prefill.
    QueueVariant("wait-half-ttft", wait_ttft_factor=0.5),
)


@dataclass(frozen=True, slots=True)
class Trial:
    """One fleet size with one queue variant, and its repeats (only up to the first failing one)."""

    engines: int
    variant: QueueVariant
    policy: Path
    runs: tuple[SideRun, ...]
    attainment: Mapping[str, tuple[float, ...]]
    """Per target class, its attainment in each repeat run."""
    passed: bool
    margin: float
    """The worst repeat's attainment less its target, lowest over the classes (negative: failed)."""


@dataclass(frozen=True, slots=True)
class PlanResult:
    """The answer (``chosen``: None when nothing up to ``max_engines`` passes) and every trial."""

    targets: Mapping[str, float]
    max_engines: int
    repeats: int
    trials: tuple[Trial, ...]
    """In the order they ran."""
    base_engines: int | None
    """The smallest size that passes with the policy's queues as written (steps 2 and 3)."""
    monotone: bool
    chosen: Trial | None
    cost_per_engine_hour: float | None
    """One engine per served model, from the policy's prices (None: unpriced)."""

    @property
    def engines(self) -> int | None:
        return None if self.chosen is None else self.chosen.engines

    @property
    def variant(self) -> QueueVariant | None:
        return None if self.chosen is None else self.chosen.variant

    def cost_at(self, engines: int) -> float | None:
        return None if self.cost_per_engine_hour is None else self.cost_per_engine_hour * engines

    @property
    def cost_per_hour(self) -> float | None:
        """Of the chosen size (None: unpriced, or no answer)."""
        return None if self.chosen is None else self.cost_at(self.chosen.engines)

    @property
    def cost_per_goodput_request(self) -> Spread:
        """Over the chosen trial's repeats (empty without an answer)."""
        runs = () if self.chosen is None else self.chosen.runs
        return Spread(tuple(cost_per_goodput_request(run, self.cost_per_hour) for run in runs))


async def plan(
    trace: Trace,
    policy: Path,
    settings: StageSettings,
    slo_targets: Mapping[str, float],
    replayer: Replayer,
    *,
    work_dir: Path,
    port_base: int,
    max_engines: int = DEFAULT_MAX_ENGINES,
    queue_variants: Sequence[QueueVariant] = QUEUE_VARIANTS,
    repeats: int = 2,
) -> PlanResult:
    """The search of the module docstring; ``settings.engines`` is ignored (the plan sets it)."""
    document = load_policy(policy)
    check_request(document, slo_targets, max_engines=max_engines, repeats=repeats)
    variants = (AS_WRITTEN, *(v for v in queue_variants if v.name != AS_WRITTEN.name))
    trials = _Trials(trace, policy, document, settings, slo_targets, replayer, repeats, work_dir, port_base)
    base, monotone = await _search_size(trials, max_engines)
    size = await _step_down(trials, max_engines + 1 if base is None else base, variants)
    chosen = await _best_variant(trials, size, variants) if size <= max_engines else None
    return PlanResult(
        targets=dict(slo_targets),
        max_engines=max_engines,
        repeats=repeats,
        trials=tuple(trials.order),
        base_engines=base,
        monotone=monotone,
        chosen=chosen,
        cost_per_engine_hour=fleet_cost_per_hour(document, 1),
    )


async def _search_size(trials: _Trials, max_engines: int) -> tuple[int | None, bool]:
    """Steps 2 and 3: the smallest passing size with the queues as written, and whether the
    confirmations held."""
    found = await _exponential_then_binary(trials, max_engines)
    monotone = True
    while found is not None and found < max_engines and not await trials.passes(found + 1, AS_WRITTEN):
        monotone = False
        found = await _first_passing(trials, found + 2, max_engines)
    return found, monotone


async def _exponential_then_binary(trials: _Trials, max_engines: int) -> int | None:
    failing, size = 0, 1
    while not await trials.passes(size, AS_WRITTEN):
        if size >= max_engines:
            return None
        failing, size = size, min(2 * size, max_engines)
    passing = size
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if await trials.passes(middle, AS_WRITTEN):
            passing = middle
        else:
            failing = middle
    return passing


async def _first_passing(trials: _Trials, start: int, max_engines: int) -> int | None:
    for size in range(start, max_engines + 1):
        if await trials.passes(size, AS_WRITTEN):
            return size
    return None


async def _step_down(trials: _Trials, size: int, variants: Sequence[QueueVariant]) -> int:
    """Step 4's descent: one engine fewer while some queue variant passes there."""
    while size > 1 and await _any_passes(trials, size - 1, variants):
        size -= 1
    return size


async def _any_passes(trials: _Trials, size: int, variants: Sequence[QueueVariant]) -> bool:
    for variant in variants:
        if await trials.passes(size, variant):
            return True
    return False


async def _best_variant(trials: _Trials, size: int, variants: Sequence[QueueVariant]) -> Trial | None:
    """Every variant at ``size``; the passing one with the largest margin, the first on a tie."""
    results = [await trials.run(size, variant) for variant in variants]
    passing = [t for t in results if t.passed]
    return max(passing, key=lambda t: t.margin) if passing else None


class _Trials:
    """Runs trials and remembers them, so that no (size, variant) is replayed twice."""

    def __init__(
        self,
        trace: Trace,
        policy: Path,
        document: Mapping[str, Any],
        settings: StageSettings,
        targets: Mapping[str, float],
        replayer: Replayer,
        repeats: int,
        work_dir: Path,
        port_base: int,
    ) -> None:
        self._trace, self._policy, self._document, self._settings = trace, policy, document, settings
        self._targets, self._replayer, self._repeats = targets, replayer, repeats
        self._work_dir, self._port_base = work_dir, port_base
        self._done: dict[tuple[int, str], Trial] = {}
        self.order: list[Trial] = []

    async def passes(self, engines: int, variant: QueueVariant) -> bool:
        return (await self.run(engines, variant)).passed

    async def run(self, engines: int, variant: QueueVariant) -> Trial:
        key = (engines, variant.name)
        if key not in self._done:
            self._done[key] = await self._replay(engines, variant)
            self.order.append(self._done[key])
        return self._done[key]

    async def _replay(self, engines: int, variant: QueueVariant) -> Trial:
        policy = self._policy_for(variant)
        label = trial_label(engines, variant)
        settings = replace(self._settings, engines=engines)
        runs: list[SideRun] = []
        for repeat in range(self._repeats):
            run = await self._replayer(  # its files go to <work_dir>/<label>-r<repeat>/
                self._trace,
                policy,
                settings,
                side=label,
                repeat=repeat,
                work_dir=self._work_dir,
                port_base=self._port_base,
            )
            runs.append(run)
            if margin(run, self._targets) < 0:
                break
        return _trial(engines, variant, policy, runs, self._targets)

    def _policy_for(self, variant: QueueVariant) -> Path:
        if variant.name == AS_WRITTEN.name:
            return self._policy
        path = self._work_dir / "policies" / f"{self._policy.stem}-{variant.name}.yaml"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(with_queue_variant(self._document, variant), sort_keys=False)
            path.write_text(text, encoding="utf-8")
        return path


def trial_label(engines: int, variant: QueueVariant) -> str:
    """The ``SideRun.side`` of a plan's run (and its folder): ``engines=3``, or ``engines=3,wait-ttft``."""
    return f"engines={engines}" if variant.name == AS_WRITTEN.name else f"engines={engines},{variant.name}"


def _trial(
    engines: int, variant: QueueVariant, policy: Path, runs: Sequence[SideRun], targets: Mapping[str, float]
) -> Trial:
    shares = {name: tuple(class_attainment(run, name) for run in runs) for name in targets}
    worst = min(min(values) - targets[name] for name, values in shares.items())
    return Trial(engines, variant, policy, tuple(runs), shares, worst >= 0, worst)


def class_attainment(run: SideRun, class_name: str) -> float:
    """The share of a class's requests that met its SLO in one run (errors count as misses)."""
    records = [r for r in run.records if r.class_name == class_name]
    if not records:
        raise ValueError(f"class {class_name!r} has no requests in the replay of {run.side}: no target can hold")
    return sum(1 for r in records if r.slo_met) / len(records)


def margin(run: SideRun, targets: Mapping[str, float]) -> float:
    """The lowest attainment less target over the classes: a run passes when it is at least 0."""
    return min(class_attainment(run, name) - target for name, target in targets.items())


def load_policy(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not isinstance(document.get("classes"), dict):
        raise ValueError(f"{path}: not a policy (no classes)")
    return document


def check_request(document: Mapping[str, Any], targets: Mapping[str, float], *, max_engines: int, repeats: int) -> None:
    """Refuse a plan that could not mean anything, before any replay."""
    if not targets:
        raise ValueError("at least one class needs an attainment target")
    unknown = sorted(set(targets) - set(document["classes"]))
    if unknown:
        raise ValueError(f"no class {', '.join(unknown)} in the policy (it has {', '.join(document['classes'])})")
    for name, target in targets.items():
        if not 0 < target <= 1:
            raise ValueError(f"the attainment target of {name} must be within (0, 1], not {target}")
    if max_engines < 1 or repeats < 1:
        raise ValueError("max_engines and repeats must be at least 1")


def with_queue_variant(document: Mapping[str, Any], variant: QueueVariant) -> dict[str, Any]:
    """A copy of the policy document with ``variant`` applied to every class's ``queue``."""
    out = copy.deepcopy(dict(document))
    for name, spec in out["classes"].items():
        queue = queue_settings(out)[name]
        depth = int(queue["max_depth"])
        queue["max_depth"] = max(1, round(depth * variant.depth_factor)) if depth > 0 else 0
        if variant.wait_ttft_factor is not None:
            queue["max_wait_s"] = float(spec["slo"]["ttft_ms"]) / 1000 * variant.wait_ttft_factor
        spec["queue"] = queue
    return out


def queue_settings(document: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each class's ``queue`` as the gateway will read it (``max_depth`` filled in when unset)."""
    default_depth = QueuePolicy.model_fields["max_depth"].default
    return {
        name: {"max_depth": default_depth, **(spec.get("queue") or {})} for name, spec in document["classes"].items()
    }


def fleet_cost_per_hour(document: Mapping[str, Any], engines: int) -> float | None:
    """``engines × gpus × price_per_gpu_hour`` of each distinct first backend of a served model;
    None when one of them has no price."""
    firsts: dict[str, Mapping[str, Any]] = {}
    for model in document.get("models", []):
        backend = next((b for b in document.get("backends", []) if model["name"] in b.get("models", [])), None)
        if backend is not None:
            firsts[backend["name"]] = backend
    prices = [b.get("price_per_gpu_hour") for b in firsts.values()]
    if not firsts or any(p is None for p in prices):
        return None
    return sum(engines * int(b.get("gpus", 1)) * float(b["price_per_gpu_hour"]) for b in firsts.values())
