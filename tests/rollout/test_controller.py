"""The rollouts of the policy in force across reloads and restarts (real file store, real metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.policy.snapshot import PolicySnapshot
from gateway.rollout.controller import Rollouts
from gateway.rollout.judge import Action
from gateway.rollout.store import FileRolloutStore
from gateway.service import parse_policy
from gateway.telemetry.metrics import Metrics
from tests.fake_clock import FakeClock
from tests.policy_builder import KEY_ACME, NOWHERE, backend, build_policy, model, tenant


def snapshot(steps: list[int], *, rollout: bool = True) -> PolicySnapshot:
    group: dict[str, Any] = {"name": "pub", "targets": [{"model": "v1"}, {"model": "v2"}]}
    if rollout:
        group["rollout"] = {"baseline": "v1", "candidate": "v2", "steps": steps, "interval_s": 1}
    text = build_policy(
        models=[model("v1"), model("v2")],
        backends=[backend("b", NOWHERE, ["v1", "v2"])],
        model_groups=[group],
        tenants=[tenant("acme", KEY_ACME)],
    )
    return parse_policy(text, "p.yaml")


def rollouts(directory: Path, metrics: Metrics | None = None) -> Rollouts:
    return Rollouts(FileRolloutStore(directory), metrics or Metrics(), FakeClock(0.0), holder="test")


async def test_a_rollback_holds_across_a_reload_that_keeps_the_rollout_and_across_a_restart(tmp_path: Path) -> None:
    first = snapshot([10, 100])
    live = rollouts(tmp_path)
    live.adopt(first)
    await live.start()
    group = first.groups["pub"]
    assert live.candidate_percent(group) == 10
    await live.force("pub", Action.ROLLBACK, "sre", "pager")
    live.adopt(snapshot([10, 100]))  # a reload that leaves the rollout as it was
    assert live.candidate_percent(group) == 0
    restarted = rollouts(tmp_path)
    restarted.adopt(first)
    await restarted.start()
    assert restarted.candidate_percent(group) == 0


async def test_a_changed_rollout_starts_afresh_and_a_removed_one_leaves_no_gauges(tmp_path: Path) -> None:
    metrics = Metrics()
    live = rollouts(tmp_path, metrics)
    live.adopt(snapshot([10, 100]))
    await live.start()
    await live.force("pub", Action.ROLLBACK, "sre")
    changed = snapshot([20, 100])
    live.adopt(changed)  # new steps: another rollout, from its first step
    await live.start()
    assert live.candidate_percent(changed.groups["pub"]) == 20
    live.adopt(snapshot([20, 100], rollout=False))
    exported = metrics.exposition().decode()
    assert 'gateway_rollout_candidate_percent{candidate="v2",group="pub"}' not in exported
    assert live.status() == []
