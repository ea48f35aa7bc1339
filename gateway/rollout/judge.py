"""A canary rollout's tally of one interval and its verdict on one step; pure (no I/O, no clock).

The tally. Each process adds the finished requests of the rollout's two arms to a ``Tally`` and
``flush``es it once per evaluation interval into counts: requests per arm and, per arm, the bad
events of each signal of ``sprt.SIGNALS``:

* ``errors``: the request failed (5xx, upstream error, timeout, broken stream);
* ``refusals``: its arm had no room or refused it (429/503, queue full, ...);
* ``slo_misses``: it completed and missed its SLO (a request that did not complete is an error
  or a refusal, not a miss);
* ``slow_ttft`` / ``slow_itl``: its TTFT (mean ITL) is strictly above the ``slow_quantile``
  quantile (nearest rank) of the values of *both* arms of its class in this interval. The
  threshold is pooled so that, under H0, the arms are exchangeable and each slow event is the
  candidate's with probability exactly ``pi``, as the test assumes; a class with fewer than
  ``min_class_samples`` values in the interval gives no slow events.

Requests count in the arm they were *assigned* to (intent to treat), even when they then fell
back elsewhere: only the random assignment makes the test valid. Every count is a sum over
requests, so the counts of several processes add up (that is how replicas share one verdict)
and the counts of a step are the sums of its intervals.

The verdict. ``judge`` reads the current step's summed counts and, with ``pi`` the step's share
and ``threshold = sprt.rollback_threshold(policy.test, judged_steps(policy))``:

1. a terminal state (promoted, rolled back) stays: CONTINUE;
2. any signal's LLR >= threshold: ROLLBACK (status rolled_back);
3. fewer than ``min_requests`` candidate requests, or the step younger than ``policy.step_s``:
   HOLD, status holding if any LLR >= threshold/2 (it looks worse) else progressing;
4. any LLR >= threshold/2: HOLD, status holding (looks worse, not yet significant);
5. held by an operator: HOLD (the canary may roll back, never promote, until resumed);
6. else PROMOTE to the next step (a fresh test: the caller starts the new step's counts from
   zero), or COMPLETE (status promoted) when the next step is the last (100).

A verdict's state is the very object passed in when the status does not change (so the caller
writes the state only when ``verdict.state is not state``); a new step is told by a new
``step_started_at``. Operators move a rollout with ``force`` (promote, complete, rollback,
hold, and CONTINUE to resume).

Usage::

    key = rollout_key(group.name, policy)
    state = stored if stored is not None and stored.key == key else RolloutState.start(key, now)
    tally.add(Observation(candidate=True, class_name="interactive", error=False, refused=False,
                          slo_met=True, ttft_s=0.21, itl_s=0.03))
    counts = tally.flush(policy.test.slow_quantile)       # each interval; summed over replicas
    verdict = judge(policy, state, step_counts, now)      # step_counts: the step's sums so far
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from gateway.policy.groups import RolloutPolicy
from gateway.rollout.sprt import SIGNALS, log_likelihood_ratio, rollback_threshold

ARMS: tuple[str, str] = ("candidate", "baseline")
MAX_OBSERVATIONS = 200_000
"""A tally holds at most one interval; past this many observations it drops them and counts them."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One finished request of the rollout's two arms, as the canary sees it."""

    candidate: bool
    """The arm it was assigned to (intent to treat: even if it then fell back)."""
    class_name: str
    error: bool
    """It failed (5xx, upstream error, timeout, broken stream)."""
    refused: bool
    """Its arm had no room or refused it (429/503, queue full, ...), whatever happened after."""
    slo_met: bool | None
    """None when it did not complete."""
    ttft_s: float | None
    itl_s: float | None
    """The request's mean gap between output events; None under 2 events."""


def _arm(candidate: bool) -> str:
    return ARMS[0] if candidate else ARMS[1]


def _slow_count(values: list[tuple[float, bool]], quantile: float, counts: dict[str, int], signal: str) -> None:
    """Count, per arm, the values strictly above the pooled ``quantile`` (nearest rank)."""
    ranked = sorted(value for value, _ in values)
    threshold = ranked[max(0, min(len(ranked) - 1, math.ceil(quantile * len(ranked) - 1e-9) - 1))]
    for value, candidate in values:
        if value > threshold:
            key = f"{_arm(candidate)}:{signal}"
            counts[key] = counts.get(key, 0) + 1


class Tally:
    """Observations of one evaluation interval, turned into counts at ``flush``.

    Counts (requests, errors, refusals, SLO misses) are kept as they come; latencies are kept per
    class until ``flush``, which needs the interval's pooled quantile. At most ``max_observations``
    per interval: the rest are dropped whole (so every count stays a count of the same requests)
    and counted in ``dropped``, which only grows.
    """

    __slots__ = ("_counts", "_itl", "_seen", "_ttft", "dropped", "max_observations")

    def __init__(self, max_observations: int = MAX_OBSERVATIONS) -> None:
        self.max_observations = max_observations
        self.dropped = 0
        self._seen = 0
        self._counts: dict[str, int] = {}
        self._ttft: defaultdict[str, list[tuple[float, bool]]] = defaultdict(list)
        self._itl: defaultdict[str, list[tuple[float, bool]]] = defaultdict(list)

    def __len__(self) -> int:
        return self._seen

    def add(self, obs: Observation) -> None:
        if self._seen >= self.max_observations:
            self.dropped += 1
            return
        self._seen += 1
        arm = _arm(obs.candidate)
        self._bump(f"{arm}:requests")
        if obs.error:
            self._bump(f"{arm}:errors")
        if obs.refused:
            self._bump(f"{arm}:refusals")
        if obs.slo_met is False:
            self._bump(f"{arm}:slo_misses")
        if obs.ttft_s is not None and math.isfinite(obs.ttft_s):
            self._ttft[obs.class_name].append((obs.ttft_s, obs.candidate))
        if obs.itl_s is not None and math.isfinite(obs.itl_s):
            self._itl[obs.class_name].append((obs.itl_s, obs.candidate))

    def flush(self, slow_quantile: float, min_class_samples: int = 20) -> dict[str, int]:
        """The interval's counts (zero entries omitted); the tally starts a new interval.

        A class with fewer than ``min_class_samples`` latencies of a kind keeps them for the next
        interval rather than losing them: at a low rate (or a short interval) no single interval
        may hold enough to set a threshold, and a slow candidate must not pass unseen for lack of
        them. Pooling two intervals of one step keeps the arms exchangeable under "as good" (the
        controller starts a new tally when the step, hence the share, changes)."""
        counts = self._counts
        carried: dict[str, defaultdict[str, list[tuple[float, bool]]]] = {}
        for signal, by_class in (("slow_ttft", self._ttft), ("slow_itl", self._itl)):
            keep = carried[signal] = defaultdict(list)
            for class_name, values in by_class.items():
                if len(values) >= max(1, min_class_samples):
                    _slow_count(values, slow_quantile, counts, signal)
                else:
                    keep[class_name] = values
        self._counts, self._seen = {}, 0
        self._ttft, self._itl = carried["slow_ttft"], carried["slow_itl"]
        return counts

    def _bump(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1


class Status(StrEnum):
    """Where a rollout is; the values go to the stored state and the metric label."""

    PROGRESSING = "progressing"
    HOLDING = "holding"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


class Action(StrEnum):
    """What a verdict (or an operator) does to a rollout; CONTINUE from an operator is "resume"."""

    PROMOTE = "promote"
    HOLD = "hold"
    ROLLBACK = "rollback"
    COMPLETE = "complete"
    CONTINUE = "continue"


TERMINAL = frozenset({Status.PROMOTED, Status.ROLLED_BACK})
CANARY = "canary"
OPERATOR = "operator:"


class RolloutTransitionError(ValueError):
    """An operator action that does not apply to the rollout's state (e.g. promoting a finished one)."""


@dataclass(frozen=True, slots=True)
class RolloutState:
    """What survives restarts: where the rollout ``key`` is (times are wall-clock epoch seconds)."""

    key: str
    """The group name and a digest of (baseline, candidate, steps): see ``rollout_key``."""
    step: int
    """Index into ``policy.steps``."""
    status: Status
    step_started_at: float
    updated_at: float
    reason: str = ""
    by: str = CANARY
    """``"canary"`` or ``"operator:<who>"``."""

    @property
    def held_by_operator(self) -> bool:
        return self.status is Status.HOLDING and self.by.startswith(OPERATOR)

    def candidate_percent(self, policy: RolloutPolicy) -> float:
        """The candidate's percent of the two arms' traffic now (the state must be ``policy``'s)."""
        if self.status is Status.ROLLED_BACK:
            return 0.0
        if self.status is Status.PROMOTED:
            return 100.0
        return float(policy.steps[self.step])

    @staticmethod
    def start(key: str, now: float) -> RolloutState:
        return RolloutState(key, 0, Status.PROGRESSING, now, now, "started")

    def to_json(self) -> str:
        return json.dumps(
            {
                "key": self.key,
                "step": self.step,
                "status": self.status.value,
                "step_started_at": self.step_started_at,
                "updated_at": self.updated_at,
                "reason": self.reason,
                "by": self.by,
            },
            sort_keys=True,
        )

    @staticmethod
    def from_json(data: str | bytes) -> RolloutState:
        """Parse ``to_json``'s output; raises ``ValueError`` on anything else."""
        raw: Any = json.loads(data)
        try:
            state = RolloutState(
                key=_typed(raw["key"], str),
                step=_typed(raw["step"], int),
                status=Status(raw["status"]),
                step_started_at=float(_typed(raw["step_started_at"], (int, float))),
                updated_at=float(_typed(raw["updated_at"], (int, float))),
                reason=_typed(raw.get("reason", ""), str),
                by=_typed(raw.get("by", CANARY), str),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a rollout state: {exc!r}") from exc
        if state.step < 0:
            raise ValueError("not a rollout state: negative step")
        return state


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"unexpected {type(value).__name__}")
    return value


def rollout_key(group: str, policy: RolloutPolicy) -> str:
    """``group:<12 hex>``, the hex from SHA-256 over baseline, candidate and steps: changing any of
    them is a new rollout that starts afresh (changing the test or the timing is not)."""
    body = json.dumps([policy.baseline, policy.candidate, [repr(float(s)) for s in policy.steps]])
    return f"{group}:{hashlib.sha256(body.encode()).hexdigest()[:12]}"


def judged_steps(policy: RolloutPolicy) -> int:
    """The steps that are judged: all but the last (100), at least one for the threshold's sake."""
    return max(1, sum(1 for s in policy.steps if s < 100))


@dataclass(frozen=True, slots=True)
class RolloutVerdict:
    """What ``judge`` decided, the state after it, and why."""

    action: Action
    state: RolloutState
    """The state after the verdict (the same object when it does not change)."""
    reason: str
    """One sentence for the SRE, with the figures."""
    evidence: dict[str, float]
    """The LLR of each signal."""
    threshold: float


def _evidence(counts: Mapping[str, int], share: float, relative_risk: float) -> dict[str, float]:
    return {
        s: log_likelihood_ratio(counts.get(f"candidate:{s}", 0), counts.get(f"baseline:{s}", 0), share, relative_risk)
        for s in SIGNALS
    }


def _figures(signal: str, llr: float, threshold: float, counts: Mapping[str, int]) -> str:
    c, n_c = counts.get(f"candidate:{signal}", 0), counts.get("candidate:requests", 0)
    b, n_b = counts.get(f"baseline:{signal}", 0), counts.get("baseline:requests", 0)
    arms = f"candidate {c} of {n_c} requests, baseline {b} of {n_b}"
    return f"{signal} LLR {llr:.2f}, rollback at {threshold:.2f}: {arms}"


def _at(policy: RolloutPolicy, step: int) -> str:
    return f"step {step + 1}/{len(policy.steps)} ({policy.steps[step]:g}%)"


def _moved(state: RolloutState, now: float, **changes: Any) -> RolloutState:
    return replace(state, updated_at=now, **changes)


def judge(policy: RolloutPolicy, state: RolloutState, counts: Mapping[str, int], now: float) -> RolloutVerdict:
    """The verdict on the current step from its summed ``counts`` (the rules: module docstring)."""
    threshold = rollback_threshold(policy.test, judged_steps(policy))
    if state.status in TERMINAL:
        return RolloutVerdict(Action.CONTINUE, state, f"the rollout is over ({state.status})", {}, threshold)
    share = policy.steps[state.step] / 100
    if share >= 1.0:
        done = _moved(state, now, status=Status.PROMOTED, by=CANARY, reason="at 100%: nothing left to judge")
        return RolloutVerdict(Action.COMPLETE, done, done.reason, {}, threshold)
    evidence = _evidence(counts, share, policy.test.relative_risk)
    worst = max(SIGNALS, key=lambda s: evidence[s])
    figures = _figures(worst, evidence[worst], threshold, counts)
    here = _at(policy, state.step)
    if evidence[worst] >= threshold:
        reason = f"rolled back at {here}: the candidate is worse on {figures}"
        return RolloutVerdict(Action.ROLLBACK, _rollback(state, now, reason), reason, evidence, threshold)
    suspicious = evidence[worst] >= threshold / 2
    requests = counts.get("candidate:requests", 0)
    age = now - state.step_started_at
    if requests < policy.min_requests or age < policy.step_s:
        looks = f"and {worst} looks worse ({figures})" if suspicious else f"and nothing looks worse (largest {figures})"
        reason = (
            f"holding at {here} for data: {requests} of {policy.min_requests} candidate requests, "
            f"{age:.0f} s of {policy.step_s:g} s, {looks}"
        )
        return _hold(state, now, reason, suspicious, evidence, threshold)
    if suspicious:
        reason = f"holding at {here}: {worst} looks worse but is not yet significant ({figures})"
        return _hold(state, now, reason, True, evidence, threshold)
    if state.held_by_operator:
        reason = f"held at {here} by {state.by.removeprefix(OPERATOR)}: would promote (largest {figures})"
        return RolloutVerdict(Action.HOLD, state, reason, evidence, threshold)
    reason = f"nothing looks worse after {requests} candidate requests and {age:.0f} s (largest {figures})"
    new = _advance(policy, state, now, CANARY, reason)
    action = Action.COMPLETE if new.status is Status.PROMOTED else Action.PROMOTE
    return RolloutVerdict(action, new, new.reason, evidence, threshold)


def _hold(
    state: RolloutState, now: float, reason: str, suspicious: bool, evidence: dict[str, float], threshold: float
) -> RolloutVerdict:
    """HOLD: the status becomes holding when it looks worse, progressing when not (an operator's
    hold stays); the state object is kept when the status does not change."""
    status = Status.HOLDING if suspicious or state.held_by_operator else Status.PROGRESSING
    new = state if status is state.status else _moved(state, now, status=status, reason=reason)
    return RolloutVerdict(Action.HOLD, new, reason, evidence, threshold)


def _rollback(state: RolloutState, now: float, reason: str, by: str = CANARY) -> RolloutState:
    return _moved(state, now, status=Status.ROLLED_BACK, reason=reason, by=by)


def _advance(policy: RolloutPolicy, state: RolloutState, now: float, by: str, why: str) -> RolloutState:
    """The next step (a fresh test from ``now``), or promoted when the next is the last."""
    nxt = state.step + 1
    if nxt >= len(policy.steps) - 1:
        last, reason = len(policy.steps) - 1, f"promoted to 100%: {why}"
        return _moved(state, now, step=last, status=Status.PROMOTED, step_started_at=now, by=by, reason=reason)
    reason = f"promoted to {_at(policy, nxt)}: {why}"
    return _moved(state, now, step=nxt, status=Status.PROGRESSING, step_started_at=now, by=by, reason=reason)


def force(
    policy: RolloutPolicy, state: RolloutState, action: Action, who: str, now: float, reason: str = ""
) -> RolloutState:
    """An operator's action on the rollout, by ``who``; ``reason`` is kept in the state.

    * PROMOTE: the next step (a fresh test), or promoted from the one before the last;
    * COMPLETE: promoted at once;
    * ROLLBACK: rolled back, also after a promotion (the candidate gets no traffic);
    * HOLD: holding by ``operator:<who>``: the canary keeps judging and may roll back, never promotes;
    * CONTINUE (resume): progressing again, judged by the canary; after a rollback it restarts the
      step where it stopped, as a fresh test.

    Resuming a rollout the canary already drives returns ``state`` itself. Raises
    ``RolloutTransitionError`` when the action does not apply: promote, complete, hold or resume a
    promoted rollout, promote, complete or hold a rolled-back one (resume it first).
    """
    by = f"{OPERATOR}{who}"
    why = f"by {who}" + (f": {reason}" if reason else "")
    finished = state.status in TERMINAL
    if action is Action.ROLLBACK:
        return _rollback(state, now, f"rolled back {why}", by)
    if action is Action.CONTINUE and state.status is not Status.PROMOTED:
        if state.status is Status.PROGRESSING and state.by == CANARY:
            return state
        restart = now if state.status is Status.ROLLED_BACK else state.step_started_at
        resumed = f"resumed {why}"
        return _moved(state, now, status=Status.PROGRESSING, step_started_at=restart, by=CANARY, reason=resumed)
    if finished or action is Action.CONTINUE:
        raise RolloutTransitionError(f"cannot {action} a rollout that is {state.status}")
    if action is Action.PROMOTE:
        return _advance(policy, state, now, by, why)
    if action is Action.COMPLETE:
        last = len(policy.steps) - 1
        return _moved(state, now, step=last, status=Status.PROMOTED, by=by, reason=f"promoted to 100% {why}")
    return _moved(state, now, status=Status.HOLDING, by=by, reason=f"held {why}")
