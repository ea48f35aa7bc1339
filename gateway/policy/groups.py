"""Typed model of a policy's ``model_groups``: public model names mapped onto served models.

A *target* is one entry of ``models:`` (a served model name, its limits and routing, on the
backends that list it). A *model group* is the name clients call: its requests go to one of
its targets by weight, fall back down an ordered chain when the chosen target has no room,
is failing or refuses, may be copied to a shadow target, and may move traffic from a baseline
target to a candidate step by step under a canary that decides by itself
(``gateway/rollout/``). A model that is a target, fallback or shadow of some group is
*internal*: ``GET /v1/models`` does not list it and clients cannot call it by name, so no
client bypasses a group's split or its rollout.

Usage::

    models:
      - {name: llama-8b-v1, upstream_name: meta-llama/Llama-3.1-8B-Instruct}
      - {name: llama-8b-v2, upstream_name: meta-llama/Llama-3.1-8B-Instruct}
      - {name: llama-70b}
    model_groups:
      - name: llama-3.1-8b                # what clients call
        targets:
          - {model: llama-8b-v1, weight: 90}
          - {model: llama-8b-v2, weight: 10}
        fallbacks: [llama-70b]            # every class, in order
        class_fallbacks: {batch: []}      # batch never falls back
        fallback_wait_s: 0.2              # wait at most this long for the primary before falling back
        shadow: {model: llama-8b-v3, percent: 5, max_concurrent: 4, scorer: jaccard}
        rollout:
          baseline: llama-8b-v1
          candidate: llama-8b-v2
          steps: [1, 5, 25, 50, 100]
          interval_s: 60
"""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Target(_Strict):
    """One served model (a name under ``models:``) and its share of the group's traffic."""

    model: Name
    weight: Annotated[float, Field(ge=0, le=1_000_000)] = 1.0


class ShadowPolicy(_Strict):
    """Copy ``percent`` of the group's requests to ``model``; the copy's answer is read to the end and
    measured, never sent to the client.

    A shadow request runs in the batch class, never waits in a queue (no room now: it is dropped),
    never holds more than ``max_concurrent`` slots, gives its slot back the moment a real request
    would have to wait for one (``gateway/shadow/``), and is not charged to the tenant's limits.
    ``scorer`` names a quality scorer (``gateway/shadow/scorers.py``) that compares the shadow's
    answer with the primary's.
    """

    model: Name
    percent: Annotated[float, Field(gt=0, le=100)]
    max_concurrent: Annotated[int, Field(ge=1, le=10_000)] = 4
    scorer: Name | None = None


class CanaryTest(_Strict):
    """The sequential test a canary step is judged by (``gateway/rollout/sprt.py``).

    For every signal (errors, refusals, SLO misses, slow TTFT, slow ITL), Wald's likelihood
    ratio of "the candidate's bad events are ``relative_risk`` times as likely as the baseline's"
    against "as likely", over the bad events of both arms, one fresh test per judged step; a
    rollback once any ratio reaches ``signals x judged steps / alpha`` (Ville's inequality and a
    Bonferroni bound: the chance that a candidate as good as the baseline is ever rolled back,
    however long it is watched, is at most ``alpha``).
    """

    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.05
    relative_risk: Annotated[float, Field(gt=1, le=100)] = 2.0
    slow_quantile: Annotated[float, Field(gt=0.5, lt=1)] = 0.9
    """A request of the canary's arms is *slow* when its TTFT (or mean ITL) is above this quantile
    of both arms' values in its evaluation interval, for its class (pooled, so that under "as
    good" a slow request is the candidate's exactly as often as the candidate gets traffic)."""


class RolloutPolicy(_Strict):
    """Move the traffic of ``baseline`` to ``candidate`` by ``steps`` (percent), judged each ``interval_s``.

    The two share what their weights give them together; the candidate's part of it is the
    current step. A step is promoted after at least ``min_step_s`` and ``min_requests`` candidate
    requests without any signal looking worse; the last step (100) ends the rollout promoted.
    ``state`` says where the rollout's state survives restarts (``gateway/rollout/store.py``).
    """

    baseline: Name
    candidate: Name
    steps: Annotated[tuple[Annotated[float, Field(gt=0, le=100)], ...], Field(min_length=1)] = (1, 5, 25, 50, 100)
    interval_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    min_step_s: Annotated[float, Field(ge=0, le=86_400)] | None = None
    """Defaults to ``interval_s``."""
    min_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    test: CanaryTest = CanaryTest()

    @model_validator(mode="after")
    def _steps_grow_to_all(self) -> RolloutPolicy:
        steps = self.steps
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError("steps must grow strictly")
        if steps[-1] != 100:
            raise ValueError("the last step must be 100")
        if self.baseline == self.candidate:
            raise ValueError("baseline and candidate must differ")
        return self

    @property
    def step_s(self) -> float:
        return self.interval_s if self.min_step_s is None else self.min_step_s


class ModelGroup(_Strict):
    """A public model name and what serves it (see the module docstring)."""

    name: Name
    targets: Annotated[tuple[Target, ...], Field(min_length=1)]
    fallbacks: tuple[Name, ...] = ()
    class_fallbacks: dict[Name, tuple[Name, ...]] = {}
    fallback_wait_s: Annotated[float, Field(ge=0, le=3600)] | None = None
    """How long a request may wait for its primary's room before trying the next target; unset:
    as long as its class's queue allows (a fallback then happens when that wait cannot succeed)."""
    shadow: ShadowPolicy | None = None
    rollout: RolloutPolicy | None = None
    kind: Literal["group"] = "group"

    @model_validator(mode="after")
    def _consistent(self) -> ModelGroup:
        names = [t.model for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError("a model is named twice in targets")
        if not any(t.weight > 0 for t in self.targets) and self.rollout is None:
            raise ValueError("at least one target needs a weight greater than 0")
        if self.rollout is not None:
            for role in ("baseline", "candidate"):
                if getattr(self.rollout, role) not in names:
                    raise ValueError(f"rollout.{role} must be one of the targets")
        return self

    def chain(self, class_name: str) -> tuple[str, ...]:
        """The fallback targets of ``class_name``, in order."""
        return self.class_fallbacks.get(class_name, self.fallbacks)

    def members(self) -> set[str]:
        """Every model the group sends traffic to (targets, fallbacks, shadow)."""
        out = {t.model for t in self.targets} | set(self.fallbacks)
        for chain in self.class_fallbacks.values():
            out |= set(chain)
        if self.shadow is not None:
            out.add(self.shadow.model)
        return out
