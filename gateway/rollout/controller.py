"""The canaries of the policy in force: their live split, their observations, their verdicts.

One ``Rollouts`` per gateway process. For every model group with a ``rollout``:

* the target picker asks ``candidate_percent`` on every request of the group (a dict lookup);
* every finished request of its baseline or candidate arm becomes an ``Observation``
  (``observe``, from the recorder) in this interval's ``Tally``;
* every ``interval_s`` (``tick``): the tally's counts are added to the store's totals of the
  current step (``gateway/rollout/store.py``: Redis when the policy's state is there, else a
  file), the state is read back (another process may have decided), and the process holding
  the rollout's lease judges the step on the fleet's summed counts (``judge.py``) and saves the
  new state. So one verdict serves every replica, each replica follows it within one interval,
  and a rollback is in force everywhere within one interval of the tick that decided it.

Every decision is logged (one WARNING line an SRE can grep: group, candidate, action, reason),
counted (``gateway_rollout_decisions_total``), exposed as gauges (percent, status, evidence,
threshold), kept in a short history for ``GET /admin/rollout``, and can be forced by an
operator (``POST /admin/rollout``). The state survives restarts (the store); the evidence of
the step under way does not (a restarted judge starts the step's test afresh, from the
counts still in the store).

When the store is unreachable nothing is judged: traffic keeps the last known split, and a
rollout never advances on partial data. A process that has never read a rollout's state sends
nothing to its candidate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.clock import Clock
from gateway.errors import ErrorCode
from gateway.policy.groups import ModelGroup, RolloutPolicy
from gateway.policy.snapshot import PolicySnapshot
from gateway.rollout.judge import (
    Action,
    Observation,
    RolloutState,
    RolloutVerdict,
    Status,
    Tally,
    force,
    judge,
    judged_steps,
    rollout_key,
)
from gateway.rollout.sprt import SIGNALS, rollback_threshold
from gateway.rollout.store import RolloutStore, RolloutStoreUnavailable
from gateway.routing.targets import Role, TargetChoice
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.token_stats import TokenStats

log = logging.getLogger(__name__)

REFUSALS = frozenset(
    {ErrorCode.QUEUE_FULL, ErrorCode.QUEUE_TIMEOUT, ErrorCode.DEADLINE_UNMEETABLE, ErrorCode.UPSTREAM_OVERLOADED}
)
"""Codes of a request its arm had no room for (or the engine refused)."""
NOT_THE_ARM = frozenset(
    {
        ErrorCode.TENANT_CONCURRENCY_LIMITED,
        ErrorCode.TENANT_RATE_LIMITED,
        ErrorCode.TENANT_TOKEN_LIMITED,
        ErrorCode.DRAINING,
        ErrorCode.UPSTREAM_REJECTED,
    }
)
"""Codes that say nothing of the arm: the tenant's own limits, a gateway going away, a client error."""
HISTORY = 50
OPERATOR_ACTIONS = {
    "promote": Action.PROMOTE,
    "rollback": Action.ROLLBACK,
    "hold": Action.HOLD,
    "resume": Action.CONTINUE,
}
"""``POST /admin/rollout``'s actions (``judge.force`` says what each does from each state)."""


class FinishedRequest(Protocol):
    """What a rollout reads of a finished request (the pipeline's ``RequestOutcome`` is one): the
    rollout owns the protocol it consumes, so it imports nothing of the pipeline."""

    @property
    def route(self) -> TargetChoice | None: ...
    @property
    def class_name(self) -> str: ...
    @property
    def error(self) -> ErrorCode | None: ...
    @property
    def fallback(self) -> str | None: ...
    @property
    def tokens(self) -> TokenStats | None: ...
    @property
    def completed(self) -> bool: ...
    @property
    def client_left(self) -> bool: ...
    @property
    def failed(self) -> bool: ...


def observation(outcome: FinishedRequest, slo_met: bool | None) -> Observation | None:
    """What a finished request says of its arm; None when it says nothing (not an arm of a
    rollout, the client left, or it ended for a reason that is not the arm's)."""
    route = outcome.route
    if route is None or route.role not in (Role.BASELINE, Role.CANDIDATE):
        return None
    if outcome.client_left or outcome.error in NOT_THE_ARM:
        return None
    refused = outcome.fallback in ("no_room", "refused") or outcome.error in REFUSALS
    failed = outcome.fallback in ("failed", "unavailable") or (outcome.failed and not refused)
    tokens = outcome.tokens
    gaps = tokens.gaps if tokens is not None else ()
    return Observation(
        candidate=route.role == Role.CANDIDATE,
        class_name=outcome.class_name,
        error=failed,
        refused=refused,
        slo_met=slo_met if outcome.completed else None,
        ttft_s=tokens.ttft if tokens is not None else None,
        itl_s=sum(gaps) / len(gaps) if gaps else None,
    )


@dataclass(slots=True)
class Canary:
    """One group's rollout in this process."""

    group: str
    policy: RolloutPolicy
    key: str
    state: RolloutState | None = None
    tally: Tally = field(default_factory=Tally)
    due: float = 0.0
    verdict: RolloutVerdict | None = None
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def percent(self) -> float | None:
        return None if self.state is None else self.state.candidate_percent(self.policy)


class Rollouts:
    """Every rollout of the policy in force (see the module docstring)."""

    def __init__(
        self,
        store: RolloutStore,
        metrics: Metrics,
        clock: Clock,
        *,
        holder: str,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.holder = holder
        self.wall = wall
        self._canaries: dict[str, Canary] = {}
        self._wake = asyncio.Event()

    # -- the request path -------------------------------------------------------------------

    def candidate_percent(self, group: ModelGroup) -> float | None:
        """The candidate's share of its rollout now (the target picker's ``candidate_share``)."""
        canary = self._canaries.get(group.name)
        return None if canary is None else canary.percent()

    def observe(self, outcome: FinishedRequest, slo_met: bool | None) -> None:
        """A finished request of a group (the recorder's ``on_group_outcome``)."""
        route = outcome.route
        if route is None:
            return
        canary = self._canaries.get(route.public_name)
        if canary is None or canary.state is None or canary.state.status in (Status.PROMOTED, Status.ROLLED_BACK):
            return
        seen = observation(outcome, slo_met)
        if seen is not None:
            canary.tally.add(seen)

    # -- policy ----------------------------------------------------------------------------

    def adopt(self, snapshot: PolicySnapshot) -> None:
        """Follow a policy: a rollout whose baseline, candidate and steps did not change keeps its
        state and tally; a new or changed one starts from what the store holds under its key."""
        canaries: dict[str, Canary] = {}
        for name, group in snapshot.groups.items():
            if group.rollout is None:
                continue
            key = rollout_key(name, group.rollout)
            old = self._canaries.get(name)
            if old is not None and old.key == key:
                old.policy = group.rollout
                canaries[name] = old
            else:
                canaries[name] = Canary(name, group.rollout, key)
                # The series exists from the start at 0, so that an alert's increase() sees the first rollback.
                self.metrics.child(self.metrics.rollout_decisions, name, group.rollout.candidate, "rollback", "canary")
        for name, old in self._canaries.items():
            if name not in canaries:
                self._forget_series(old)
        self._canaries = canaries
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every rollout's state before the first request (a restart resumes where it was)."""
        for canary in list(self._canaries.values()):
            try:
                await self._load(canary)
            except RolloutStoreUnavailable as error:  # the loop tries again; until then no candidate traffic
                log.warning("rollout of %s: state store unavailable at start (%s)", canary.group, error)

    async def run(self) -> None:
        """Tick each rollout every ``interval_s``; a policy reload wakes the loop at once."""
        while True:
            now = self.clock.now()
            for canary in list(self._canaries.values()):
                if canary.due <= now:
                    canary.due = now + canary.policy.interval_s
                    await self.tick(canary)
            due = min((c.due for c in self._canaries.values()), default=now + 1.0)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(due - self.clock.now(), 0.01))

    async def tick(self, canary: Canary) -> None:
        """One evaluation interval of one rollout (see the module docstring)."""
        try:
            if canary.state is None:
                await self._load(canary)
            state = canary.state
            assert state is not None
            counts = canary.tally.flush(canary.policy.test.slow_quantile)
            if counts:
                await self.store.add_counts(canary.key, step_id(state), counts)
            await self._load(canary)
            state = canary.state
            assert state is not None
            if state.status in (Status.PROMOTED, Status.ROLLED_BACK):
                return
            if not await self.store.try_lead(canary.key, self.holder, ttl_s=3 * canary.policy.interval_s):
                return
            totals = await self.store.counts(canary.key, step_id(state))
            verdict = judge(canary.policy, state, totals, self.wall())
            changed = verdict.state != state
            if changed:
                await self.store.save(canary.key, _as_dict(verdict.state))
            canary.state = verdict.state
            self._record(canary, verdict, by="canary", changed=changed)
        except RolloutStoreUnavailable as error:
            log.warning("rollout of %s: state store unavailable (%s); the split stays as it was", canary.group, error)
        self._export(canary)

    async def _load(self, canary: Canary) -> None:
        stored = await self.store.load(canary.key)
        if stored is None:
            state = RolloutState.start(canary.key, self.wall())
            await self.store.save(canary.key, _as_dict(state))
            log.warning(
                "rollout of %s started: %s -> %s at %s%%",
                canary.group,
                canary.policy.baseline,
                canary.policy.candidate,
                f"{state.candidate_percent(canary.policy):g}",
            )
        else:
            state = RolloutState.from_json(json.dumps(stored))
        if canary.state is not None and step_id(state) != step_id(canary.state):
            canary.tally = Tally()  # what was seen belongs to a step that is over
        canary.state = state
        self._export(canary)

    # -- operators -------------------------------------------------------------------------

    async def force(self, group: str, action: Action, who: str, reason: str = "") -> dict[str, Any]:
        """An operator's verdict: promote, rollback, hold or resume (``POST /admin/rollout``);
        saved first, so that it holds across restarts and every replica follows it."""
        canary = self._canaries.get(group)
        if canary is None:
            raise KeyError(group)
        if canary.state is None:
            await self._load(canary)
        assert canary.state is not None
        new = force(canary.policy, canary.state, action, who, self.wall(), reason)
        await self.store.save(canary.key, _as_dict(new))
        canary.state = new
        canary.tally = Tally()
        by = f"operator:{who}"
        self._record(canary, RolloutVerdict(action, new, new.reason, {}, self._threshold(canary)), by=by)
        self._export(canary)
        return self._describe(canary)

    def status(self) -> list[dict[str, Any]]:
        """Every rollout as ``GET /admin/rollout`` shows it."""
        return [self._describe(c) for c in self._canaries.values()]

    # -- telemetry -------------------------------------------------------------------------

    def _threshold(self, canary: Canary) -> float:
        return rollback_threshold(canary.policy.test, judged_steps(canary.policy))

    def _record(self, canary: Canary, verdict: RolloutVerdict, by: str, changed: bool = True) -> None:
        """Count every verdict; log and keep in the history those that changed the rollout (a hold
        that keeps it as it was is counted, and logged at debug level: it comes every interval)."""
        canary.verdict = verdict
        m = self.metrics
        kind = "operator" if by.startswith("operator") else "canary"
        m.child(m.rollout_decisions, canary.group, canary.policy.candidate, verdict.action.value, kind).inc()
        if verdict.action is Action.CONTINUE:
            return
        if not changed:
            log.debug("rollout of %s: %s", canary.group, verdict.reason)
            return
        entry = {
            "at": verdict.state.updated_at,
            "action": verdict.action.value,
            "by": by,
            "status": verdict.state.status.value,
            "percent": verdict.state.candidate_percent(canary.policy),
            "reason": verdict.reason,
        }
        canary.history.append(entry)
        log.warning(
            "rollout of %s (%s -> %s): %s by %s, candidate now at %s%%: %s",
            canary.group,
            canary.policy.baseline,
            canary.policy.candidate,
            verdict.action.value,
            by,
            f"{entry['percent']:g}",
            verdict.reason,
        )

    def _export(self, canary: Canary) -> None:
        m, group, candidate = self.metrics, canary.group, canary.policy.candidate
        state = canary.state
        if state is None:
            return
        # ``labels`` rather than the memo of ``Metrics.child``: these series can be removed.
        m.rollout_percent.labels(group, candidate).set(state.candidate_percent(canary.policy))
        for status in Status:
            m.rollout_status.labels(group, candidate, status.value).set(1.0 if state.status is status else 0.0)
        m.rollout_threshold.labels(group, candidate).set(self._threshold(canary))
        evidence = canary.verdict.evidence if canary.verdict is not None else {}
        for signal in SIGNALS:
            m.rollout_evidence.labels(group, candidate, signal).set(evidence.get(signal, 0.0))

    def _forget_series(self, canary: Canary) -> None:
        """A rollout the policy no longer has: its gauges go, so no alert fires on a ghost."""
        m, group, candidate = self.metrics, canary.group, canary.policy.candidate
        for gauge in (m.rollout_percent, m.rollout_threshold):
            _remove(gauge, group, candidate)
        for status in Status:
            _remove(m.rollout_status, group, candidate, status.value)
        for signal in SIGNALS:
            _remove(m.rollout_evidence, group, candidate, signal)

    def _describe(self, canary: Canary) -> dict[str, Any]:
        state, verdict = canary.state, canary.verdict
        return {
            "group": canary.group,
            "baseline": canary.policy.baseline,
            "candidate": canary.policy.candidate,
            "steps": list(canary.policy.steps),
            "interval_s": canary.policy.interval_s,
            "key": canary.key,
            "state": None if state is None else _as_dict(state),
            "candidate_percent": canary.percent(),
            "last_verdict": None
            if verdict is None
            else {"action": verdict.action.value, "reason": verdict.reason, "evidence": verdict.evidence},
            "threshold": self._threshold(canary),
            "pending_observations": len(canary.tally),
            "history": list(canary.history),
        }


def step_id(state: RolloutState) -> int:
    """The store's name for the counts of the step under way: its start, in milliseconds. Not the
    step's index: a step resumed after a rollback, or started again, must not judge the evidence
    of its earlier run."""
    return int(state.step_started_at * 1000)


def _as_dict(state: RolloutState) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(state.to_json())
    return decoded


def _remove(metric: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


async def stored_rollouts(snapshot: PolicySnapshot, store: RolloutStore) -> dict[str, tuple[float, str]]:
    """Each rollout's candidate percent and a one-line description, as stored (``policy explain``);
    a rollout never started is at its first step, one whose store cannot be read is left out."""
    out: dict[str, tuple[float, str]] = {}
    for name, group in snapshot.groups.items():
        if group.rollout is None:
            continue
        key = rollout_key(name, group.rollout)
        try:
            stored = await store.load(key)
        except RolloutStoreUnavailable:
            continue
        if stored is None:
            out[name] = (float(group.rollout.steps[0]), "not started yet: it starts at its first step")
            continue
        state = RolloutState.from_json(json.dumps(stored))
        percent = state.candidate_percent(group.rollout)
        out[name] = (percent, f"{state.status.value}, candidate at {percent:g}% ({state.by}: {state.reason})")
    return out
