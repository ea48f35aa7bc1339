"""A canary's tally of one interval and its verdict on one step.

The policy throughout: steps 1, 5, 25, 50, 100 %, 30 s per step, 50 candidate requests at least,
alpha 0.05 and relative risk 2: four judged steps, so a rollback at ``ln 400 = 5.99`` and a
suspicion at half of it. At 5 % each candidate bad event adds ``ln 2 - ln 1.05 = +0.64`` and
each baseline one ``-ln 1.05 = -0.049``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from gateway.policy.groups import RolloutPolicy
from gateway.rollout.judge import (
    Action,
    Observation,
    RolloutState,
    RolloutTransitionError,
    Status,
    Tally,
    force,
    judge,
    judged_steps,
    rollout_key,
)
from gateway.rollout.sprt import SIGNALS

POLICY = RolloutPolicy(baseline="llama-v1", candidate="llama-v2", interval_s=30, min_requests=50)
T0 = 1_700_000_000.0
THRESHOLD = math.log(400)


def obs(
    candidate: bool = False,
    class_name: str = "chat",
    *,
    error: bool = False,
    refused: bool = False,
    slo_met: bool | None = True,
    ttft_s: float | None = None,
    itl_s: float | None = None,
) -> Observation:
    return Observation(candidate, class_name, error, refused, slo_met, ttft_s, itl_s)


def counts(requests: tuple[int, int] = (100, 1900), **bad: tuple[int, int]) -> dict[str, int]:
    """The step's counts: (candidate, baseline) requests and, per signal, (candidate, baseline) bad events."""
    out = {"candidate:requests": requests[0], "baseline:requests": requests[1]}
    for signal, (c, b) in bad.items():
        out[f"candidate:{signal}"], out[f"baseline:{signal}"] = c, b
    return out


def at_step(step: int, status: Status = Status.PROGRESSING, by: str = "canary") -> RolloutState:
    return RolloutState(rollout_key("llama", POLICY), step, status, T0, T0, "", by)


# --- the tally ---------------------------------------------------------------------------------


def test_requests_and_bad_events_are_counted_in_the_arm_they_were_assigned_to() -> None:
    tally = Tally()
    tally.add(obs(candidate=True, error=True, slo_met=None))
    tally.add(obs(candidate=True, refused=True, error=True, slo_met=None))
    tally.add(obs(candidate=True, slo_met=False))
    tally.add(obs(candidate=False, refused=True, slo_met=True))
    tally.add(obs(candidate=False))
    assert tally.flush(0.9) == {
        "candidate:requests": 3,
        "candidate:errors": 2,
        "candidate:refusals": 1,
        "candidate:slo_misses": 1,
        "baseline:requests": 2,
        "baseline:refusals": 1,
    }


def test_slow_thresholds_are_pooled_over_both_arms_and_set_per_class() -> None:
    """chat: 18 baseline values 1..18 and candidate 19, 20; the pooled p90 (nearest rank, 18th of
    20) is 18, so only the candidate's two are slow (a baseline-only p90 would be 17 and make the
    baseline's 18 slow too). batch: 100..119, all baseline: its own p90 is 117, so 118 and 119 are
    slow, though every one of them is slower than all of chat."""
    tally = Tally()
    for v in range(1, 19):
        tally.add(obs(ttft_s=float(v)))
    for v in (19, 20):
        tally.add(obs(candidate=True, ttft_s=float(v)))
    for v in range(100, 120):
        tally.add(obs(class_name="batch", ttft_s=float(v)))
    got = tally.flush(0.9)
    assert (got.get("candidate:slow_ttft", 0), got.get("baseline:slow_ttft", 0)) == (2, 2)


@pytest.mark.parametrize(
    ("samples", "slow"),
    [
        pytest.param(19, 0, id="19 values of a class are too few to set a threshold"),
        pytest.param(20, 2, id="20 values set one"),
    ],
)
def test_a_small_class_gives_no_slow_events(samples: int, slow: int) -> None:
    tally = Tally()
    for v in range(samples):
        tally.add(obs(itl_s=float(v), ttft_s=None))
    got = tally.flush(0.9, min_class_samples=20)
    assert got.get("baseline:slow_itl", 0) == slow
    assert "baseline:slow_ttft" not in got


def test_a_value_equal_to_the_threshold_is_not_slow() -> None:
    tally = Tally()
    for _ in range(50):
        tally.add(obs(candidate=True, ttft_s=0.5, itl_s=0.02))
    assert tally.flush(0.9) == {"candidate:requests": 50}


def test_flush_starts_a_new_interval() -> None:
    tally = Tally()
    for v in range(30):
        tally.add(obs(error=True, ttft_s=float(v)))
    assert tally.flush(0.9)["baseline:errors"] == 30
    assert tally.flush(0.9) == {}
    assert len(tally) == 0


def test_past_its_cap_a_tally_drops_whole_observations_and_counts_them() -> None:
    tally = Tally(max_observations=3)
    for _ in range(5):
        tally.add(obs(candidate=True, error=True))
    assert tally.flush(0.9) == {"candidate:requests": 3, "candidate:errors": 3}
    assert tally.dropped == 2
    tally.add(obs())
    assert tally.flush(0.9) == {"baseline:requests": 1}
    assert tally.dropped == 2


def test_two_replicas_tallies_summed_judge_like_one_tally_of_everything() -> None:
    """Two processes each see part of the traffic and flush their own tally; the sums of their
    counts are the counts of one process that saw it all, so the verdict is the same."""
    rng = random.Random(11)
    stream = []
    for _ in range(4_000):
        candidate = rng.random() < 0.05
        error = rng.random() < (0.15 if candidate else 0.02)
        stream.append(obs(candidate=candidate, error=error, refused=rng.random() < 0.01))
    one, replicas = Tally(), (Tally(), Tally())
    for o in stream:
        one.add(o)
        replicas[rng.random() < 0.5].add(o)
    summed = Counter(replicas[0].flush(0.9)) + Counter(replicas[1].flush(0.9))
    alone = one.flush(0.9)
    assert dict(summed) == alone
    now = T0 + 60
    together, single = judge(POLICY, at_step(1), summed, now), judge(POLICY, at_step(1), alone, now)
    assert (together.action, together.evidence) == (single.action, single.evidence)
    assert together.action is Action.ROLLBACK


# --- the verdict -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step_counts", "age_s", "action", "status", "reason_has"),
    [
        pytest.param(
            counts(errors=(20, 20)),
            60,
            Action.ROLLBACK,
            Status.ROLLED_BACK,
            "errors LLR 11.91, rollback at 5.99: candidate 20 of 100 requests, baseline 20 of 1900",
            id="a signal past the threshold rolls back",
        ),
        pytest.param(
            counts((10, 190), slow_itl=(20, 20)),
            5,
            Action.ROLLBACK,
            Status.ROLLED_BACK,
            "slow_itl LLR",
            id="a rollback does not wait for the step's time or volume",
        ),
        pytest.param(
            counts((10, 190), errors=(1, 4)),
            60,
            Action.HOLD,
            Status.PROGRESSING,
            "for data: 10 of 50 candidate",
            id="too few candidate requests hold, still progressing when nothing looks worse",
        ),
        pytest.param(
            counts(errors=(1, 4)),
            10,
            Action.HOLD,
            Status.PROGRESSING,
            "10 s of 30 s",
            id="too young a step holds",
        ),
        pytest.param(
            counts((10, 190), errors=(7, 20)),
            60,
            Action.HOLD,
            Status.HOLDING,
            "for data: 10 of 50 candidate",
            id="too few requests while a signal looks worse hold as holding",
        ),
        pytest.param(
            counts(errors=(7, 20)),
            60,
            Action.HOLD,
            Status.HOLDING,
            "errors looks worse but is not yet significant",
            id="a signal past half the threshold holds with enough data",
        ),
        pytest.param(
            counts(errors=(1, 20), slow_ttft=(10, 190)),
            60,
            Action.PROMOTE,
            Status.PROGRESSING,
            "promoted to step 3/5 (25%)",
            id="enough data and nothing worse promote to the next step",
        ),
    ],
)
def test_the_rules_of_a_verdict(
    step_counts: dict[str, int], age_s: float, action: Action, status: Status, reason_has: str
) -> None:
    verdict = judge(POLICY, at_step(1), step_counts, T0 + age_s)
    assert (verdict.action, verdict.state.status) == (action, status)
    assert reason_has in verdict.reason
    assert set(verdict.evidence) == set(SIGNALS)
    assert verdict.threshold == pytest.approx(THRESHOLD)


def test_a_promotion_starts_the_next_step_as_a_fresh_test() -> None:
    verdict = judge(POLICY, at_step(1), counts(), T0 + 60)
    assert verdict.state.step == 2
    assert verdict.state.step_started_at == verdict.state.updated_at == T0 + 60
    assert verdict.state.candidate_percent(POLICY) == 25
    assert verdict.state.by == "canary"


def test_promoting_from_the_step_before_100_completes_the_rollout() -> None:
    verdict = judge(POLICY, at_step(3), counts((1000, 1000)), T0 + 60)
    assert (verdict.action, verdict.state.status) == (Action.COMPLETE, Status.PROMOTED)
    assert verdict.state.candidate_percent(POLICY) == 100


@pytest.mark.parametrize("status", [Status.PROMOTED, Status.ROLLED_BACK])
def test_a_finished_rollout_stays_finished(status: Status) -> None:
    state = at_step(2, status)
    verdict = judge(POLICY, state, counts(errors=(100, 0)), T0 + 600)
    assert verdict.action is Action.CONTINUE
    assert verdict.state is state


def test_a_hold_that_keeps_the_status_keeps_the_state_object() -> None:
    held = judge(POLICY, at_step(1), counts(errors=(7, 20)), T0 + 60).state
    again = judge(POLICY, held, counts(errors=(8, 30)), T0 + 90)
    assert again.action is Action.HOLD
    assert again.state is held
    waiting = at_step(1)
    assert judge(POLICY, waiting, counts((10, 190)), T0 + 60).state is waiting


def test_a_suspicion_that_fades_lets_the_step_progress_again() -> None:
    held = judge(POLICY, at_step(1), counts(errors=(7, 20)), T0 + 60).state
    fading = judge(POLICY, held, counts((40, 760), errors=(7, 200)), T0 + 90)
    assert (fading.action, fading.state.status) == (Action.HOLD, Status.PROGRESSING)
    cleared = judge(POLICY, fading.state, counts((100, 1900), errors=(7, 400)), T0 + 120)
    assert cleared.action is Action.PROMOTE


def test_an_operators_hold_is_never_promoted_by_the_canary_but_can_be_rolled_back() -> None:
    held = force(POLICY, at_step(1), Action.HOLD, "alice", T0 + 5, "waiting for the evals")
    assert (held.status, held.by) == (Status.HOLDING, "operator:alice")
    assert "waiting for the evals" in held.reason
    clean = judge(POLICY, held, counts((5000, 95000)), T0 + 3600)
    assert (clean.action, clean.state) == (Action.HOLD, held)
    assert clean.state is held
    assert "held at step 2/5 (5%) by alice" in clean.reason
    assert judge(POLICY, held, counts((10, 190)), T0 + 60).state is held
    bad = judge(POLICY, held, counts(errors=(20, 20)), T0 + 60)
    assert (bad.action, bad.state.status, bad.state.by) == (Action.ROLLBACK, Status.ROLLED_BACK, "canary")


def test_resuming_an_operators_hold_hands_the_step_back_to_the_canary() -> None:
    held = force(POLICY, at_step(1), Action.HOLD, "alice", T0 + 5)
    resumed = force(POLICY, held, Action.CONTINUE, "bob", T0 + 40)
    assert (resumed.status, resumed.by, resumed.step_started_at) == (Status.PROGRESSING, "canary", T0)
    assert "resumed by bob" in resumed.reason
    assert judge(POLICY, resumed, counts(), T0 + 60).action is Action.PROMOTE
    assert force(POLICY, resumed, Action.CONTINUE, "bob", T0 + 41) is resumed


def test_resuming_after_a_rollback_restarts_the_step_as_a_fresh_test() -> None:
    resumed = force(POLICY, at_step(2, Status.ROLLED_BACK), Action.CONTINUE, "carol", T0 + 500)
    assert (resumed.status, resumed.step, resumed.step_started_at) == (Status.PROGRESSING, 2, T0 + 500)
    assert resumed.candidate_percent(POLICY) == 25


@pytest.mark.parametrize(
    ("state", "action", "step", "status", "percent"),
    [
        pytest.param(at_step(1), Action.PROMOTE, 2, Status.PROGRESSING, 25, id="promote goes to the next step"),
        pytest.param(at_step(3), Action.PROMOTE, 4, Status.PROMOTED, 100, id="promote from 50 percent completes"),
        pytest.param(at_step(0), Action.COMPLETE, 4, Status.PROMOTED, 100, id="complete goes to 100 at once"),
        pytest.param(at_step(2), Action.ROLLBACK, 2, Status.ROLLED_BACK, 0, id="rollback sends the candidate nothing"),
        pytest.param(
            at_step(4, Status.PROMOTED), Action.ROLLBACK, 4, Status.ROLLED_BACK, 0, id="a promotion can be rolled back"
        ),
    ],
)
def test_operator_actions(state: RolloutState, action: Action, step: int, status: Status, percent: float) -> None:
    new = force(POLICY, state, action, "dave", T0 + 100)
    assert (new.step, new.status, new.by) == (step, status, "operator:dave")
    assert new.candidate_percent(POLICY) == percent
    assert new.updated_at == T0 + 100


@pytest.mark.parametrize(
    ("status", "action"),
    [
        (Status.PROMOTED, Action.PROMOTE),
        (Status.PROMOTED, Action.HOLD),
        (Status.PROMOTED, Action.CONTINUE),
        (Status.ROLLED_BACK, Action.PROMOTE),
        (Status.ROLLED_BACK, Action.COMPLETE),
        (Status.ROLLED_BACK, Action.HOLD),
    ],
    ids=lambda v: str(v),
)
def test_actions_that_do_not_apply_to_a_finished_rollout_are_refused(status: Status, action: Action) -> None:
    with pytest.raises(RolloutTransitionError, match=f"cannot {action}"):
        force(POLICY, at_step(2, status), action, "erin", T0)


def test_a_rollout_that_starts_at_100_completes_at_its_first_verdict() -> None:
    policy = RolloutPolicy(baseline="a", candidate="b", steps=(100,))
    verdict = judge(policy, RolloutState.start(rollout_key("g", policy), T0), {}, T0)
    assert (verdict.action, verdict.state.status) == (Action.COMPLETE, Status.PROMOTED)
    assert judged_steps(policy) == 1


# --- the state ---------------------------------------------------------------------------------


def test_a_state_survives_a_json_round_trip() -> None:
    state = replace(at_step(2, Status.HOLDING, "operator:alice"), reason="held: evals pending", updated_at=T0 + 0.25)
    assert RolloutState.from_json(state.to_json()) == state
    assert RolloutState.from_json(state.to_json().encode()) == state
    start = RolloutState.start("g:0123456789ab", T0)
    assert RolloutState.from_json(start.to_json()) == start
    assert (start.step, start.status, start.by) == (0, Status.PROGRESSING, "canary")


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"key": "g", "step": 0}', id="missing fields"),
        pytest.param(at_step(0).to_json().replace('"progressing"', '"paused"'), id="an unknown status"),
        pytest.param(at_step(0).to_json().replace('"step": 0', '"step": "0"'), id="a step that is a string"),
        pytest.param(at_step(0).to_json().replace('"step": 0', '"step": -1'), id="a negative step"),
        pytest.param("[]", id="not an object"),
        pytest.param("{", id="not json"),
    ],
)
def test_anything_but_a_state_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a rollout state|Expecting|JSON"):
        RolloutState.from_json(text)


def test_the_rollout_key_names_the_group_and_changes_with_the_rollout_not_its_timing() -> None:
    key = rollout_key("llama", POLICY)
    assert key.startswith("llama:")
    assert len(key.split(":")[1]) == 12
    assert rollout_key("llama", POLICY.model_copy(update={"steps": (10, 50, 100)})) != key
    assert rollout_key("llama", POLICY.model_copy(update={"candidate": "llama-v3"})) != key
    assert rollout_key("other", POLICY) != key
    same = RolloutPolicy(baseline="llama-v1", candidate="llama-v2", steps=(1.0, 5.0, 25.0, 50.0, 100.0), interval_s=300)
    assert rollout_key("llama", same) == key


def test_a_small_class_keeps_its_values_for_the_next_interval() -> None:
    """At a low rate no single interval may hold enough latencies for a threshold: the values
    wait for the next flush instead of being lost, so a slow candidate is still seen."""
    tally = Tally()
    for v in range(12):
        tally.add(obs(candidate=v >= 10, itl_s=float(v), ttft_s=None))
    assert "candidate:slow_itl" not in tally.flush(0.9, min_class_samples=20)
    for v in range(12, 24):
        tally.add(obs(candidate=v >= 22, itl_s=float(v), ttft_s=None))
    got = tally.flush(0.9, min_class_samples=20)
    assert got.get("candidate:slow_itl", 0) == 2  # 22 and 23: the top of the 24 pooled values
    assert got.get("baseline:slow_itl", 0) == 0
    assert tally.flush(0.9, min_class_samples=20) == {}  # used once, then gone
