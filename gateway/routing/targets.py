"""Which served model answers a request: a public name resolved to a target and its fallback chain.

A client names a public model: a plain model under ``models:`` (served as itself), or a model
group (``gateway/policy/groups.py``). For a group, one target is drawn at random by weight;
when the group has a rollout, its baseline and candidate share what their weights give them
together, the candidate getting the rollout's current percent of it (``gateway/rollout/``).
Then the chain: the class's fallback targets in order, without the target drawn, and, for a
tenant that may not fall back to something dearer (``allow_costlier_fallback: false``),
without the targets whose hourly price is above the drawn one's.

Every target is a ``ModelPolicy``: its own limits, routing, queues and backends. Moving down
the chain re-targets the request (``retarget``): a new ``model`` and a body naming the
target's served name; nothing else of the client's request changes. The client always sees
the public name it asked for (``public_name``; the answer's ``model`` is renamed back,
``served_name`` is what the engine echoes).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.errors import ModelNotFound
from gateway.policy.groups import ModelGroup
from gateway.policy.model import ModelPolicy, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.types import InferenceRequest

CandidateShare = Callable[[ModelGroup], float | None]
"""The percent of a group's rollout traffic its candidate gets now; None: no rollout in force."""


class Role:
    """How a request came to its first target (the ``role`` label of ``gateway_group_requests_total``)."""

    MODEL = "model"
    WEIGHTED = "weighted"
    BASELINE = "baseline"
    CANDIDATE = "candidate"


@dataclass(frozen=True, slots=True)
class TargetChoice:
    """The target drawn for one request, and where it may go next."""

    public_name: str
    primary: ModelPolicy
    chain: tuple[ModelPolicy, ...] = ()
    group: ModelGroup | None = None
    role: str = Role.MODEL

    @property
    def targets(self) -> tuple[ModelPolicy, ...]:
        return (self.primary, *self.chain)


def served_name(model: ModelPolicy) -> str:
    """The name the target's engines serve it under (what goes in the body's ``model``)."""
    return model.upstream_name or model.name


def target_price(snapshot: PolicySnapshot, model: str) -> float:
    """Dollars an hour of one of the target's backends, averaged (0 when none has a price)."""
    backends = snapshot.backends_by_model.get(model, ())
    if not backends:
        return 0.0
    return sum((b.price_per_gpu_hour or 0.0) * b.gpus for b in backends) / len(backends)


def lookup_public(snapshot: PolicySnapshot, name: str) -> ModelGroup | ModelPolicy:
    """The group or plain model clients call ``name``; 404 ``model_not_found`` for anything else,
    a group's internal models included (they are never called by name)."""
    group = snapshot.groups.get(name)
    if group is not None:
        return group
    model = snapshot.models.get(name)
    if model is None or name in snapshot.internal:
        raise ModelNotFound(name)
    return model


class TargetPicker:
    """Draws targets (see the module docstring); one per gateway, seeded for tests."""

    def __init__(self, candidate_share: CandidateShare | None = None, rng: random.Random | None = None) -> None:
        self.candidate_share = candidate_share
        self._random = (rng or random.Random()).random
        self._plain: dict[int, TargetChoice] = {}
        """A plain model's one choice, by the model policy's identity: built once, not per request."""

    def choose(
        self, snapshot: PolicySnapshot, public: ModelGroup | ModelPolicy, tenant: Tenant, class_name: str
    ) -> TargetChoice:
        if not isinstance(public, ModelGroup):
            choice = self._plain.get(id(public))
            if choice is None or choice.primary is not public:
                if len(self._plain) > 4096:  # policies come and go with reloads: keep it bounded
                    self._plain.clear()
                choice = self._plain[id(public)] = TargetChoice(public.name, public)
            return choice
        group = public
        weights = self.weights(group)
        primary_name = self._draw(weights)
        role = Role.WEIGHTED
        rollout = group.rollout
        if rollout is not None and primary_name in (rollout.baseline, rollout.candidate):
            role = Role.CANDIDATE if primary_name == rollout.candidate else Role.BASELINE
        models = snapshot.models
        primary = models[primary_name]
        return TargetChoice(group.name, primary, self._chain(snapshot, group, primary, tenant, class_name), group, role)

    def weights(self, group: ModelGroup) -> dict[str, float]:
        """Each target's share of the group's traffic now (the rollout's split applied)."""
        weights = {t.model: t.weight for t in group.targets}
        rollout = group.rollout
        percent = self.candidate_share(group) if rollout is not None and self.candidate_share else None
        if rollout is None:
            return weights
        if percent is None:
            percent = 0.0  # the rollout's state is not known yet: nothing to the candidate
        pair = weights[rollout.baseline] + weights[rollout.candidate]
        if pair == 0:
            pair = 1.0
        weights[rollout.candidate] = pair * percent / 100
        weights[rollout.baseline] = pair - weights[rollout.candidate]
        return weights

    def _draw(self, weights: Mapping[str, float]) -> str:
        total = sum(weights.values())
        point = self._random() * total
        last = ""
        for name, weight in weights.items():
            if weight <= 0:
                continue
            last = name
            point -= weight
            if point < 0:
                return name
        return last

    @staticmethod
    def _chain(
        snapshot: PolicySnapshot, group: ModelGroup, primary: ModelPolicy, tenant: Tenant, class_name: str
    ) -> tuple[ModelPolicy, ...]:
        names = [m for m in group.chain(class_name) if m != primary.name]
        if not tenant.allow_costlier_fallback:
            ceiling = target_price(snapshot, primary.name)
            names = [m for m in names if target_price(snapshot, m) <= ceiling]
        return tuple(snapshot.models[m] for m in dict.fromkeys(names))


def fits(request: InferenceRequest, model: ModelPolicy) -> bool:
    """Whether ``request`` (validated against its first target) is within ``model``'s limits too."""
    return request.prompt_tokens <= model.max_prompt_tokens and request.max_tokens <= model.max_output_tokens


def retarget(request: InferenceRequest, model: ModelPolicy) -> InferenceRequest:
    """The same request for another target: its model, and a body naming that target's served name."""
    body = {**request.body, "model": served_name(model)}
    return dataclasses.replace(request, model=model.name, body=body, body_modified=True, prefix_keys=None)


def unready_public(snapshot: PolicySnapshot, unready: list[str]) -> list[str]:
    """The public names no request can be served for: a plain model without a healthy backend, a
    group none of whose targets and fallbacks has one (a shadow's health is not the group's)."""
    down = set(unready)
    out = [m for m in unready if m not in snapshot.internal]
    for name, group in snapshot.groups.items():
        serving = {t.model for t in group.targets if t.weight > 0 or group.rollout is not None} | set(group.fallbacks)
        if serving <= down:
            out.append(name)
    return out


def explain_group(
    snapshot: PolicySnapshot,
    group: ModelGroup,
    weights: Mapping[str, float],
    tenant: Tenant,
    class_name: str,
    rollout: str | None,
) -> tuple[str, list[str]]:
    """``policy explain``'s lines for a group, and the target it explains the request on (the
    likeliest). ``rollout`` describes the rollout's state as read from its store."""
    total = sum(weights.values()) or 1.0
    roles = {}
    if group.rollout is not None:
        roles = {group.rollout.baseline: ", baseline", group.rollout.candidate: ", candidate"}
    shares = ", ".join(
        f"{name} ({100 * weight / total:.4g}% of requests{roles.get(name, '')})" for name, weight in weights.items()
    )
    likeliest = max(weights, key=lambda name: weights[name])
    chain = TargetPicker._chain(snapshot, group, snapshot.models[likeliest], tenant, class_name)
    dropped = [m for m in group.chain(class_name) if m != likeliest and m not in {t.name for t in chain}]
    lines = [
        f"group:   {group.name} -> {shares}; explained on {likeliest}, the likeliest",
        f"fallback ({class_name}): {' -> '.join(t.name for t in chain) or 'none'}"
        + (
            f" (not {', '.join(dropped)}: costlier, and tenant '{tenant.name}' may not fall back to a costlier target)"
            if dropped
            else ""
        )
        + (f"; waits at most {group.fallback_wait_s:g}s for room first" if group.fallback_wait_s is not None else ""),
    ]
    if group.shadow is not None:
        shadow = group.shadow
        lines.append(
            f"shadow:  {shadow.percent:g}% copied to {shadow.model} (batch class, never more than "
            f"{shadow.max_concurrent} at once, never answered to the client)"
        )
    if group.rollout is not None:
        lines.append(
            f"rollout: {group.rollout.baseline} -> {group.rollout.candidate}, steps "
            f"{', '.join(f'{s:g}%' for s in group.rollout.steps)}: {rollout or 'state unknown'}"
        )
    return likeliest, lines
