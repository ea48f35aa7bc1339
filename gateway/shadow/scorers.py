"""Quality scorers: how alike a shadow's answer is to the primary's, as a number in [0, 1].

A model group's ``shadow.scorer`` names one (``gateway/policy/groups.py``); the shadow runner
(``gateway/shadow/runner.py``) calls it once per shadow copy whose answer and primary answer
both arrived whole, and records the score in ``gateway_shadow_quality_score{scorer}``. The
runner clamps what a scorer returns to [0, 1]; a scorer never sees metrics or labels.

The scores are cheap, reference-free proxies, meant to be watched as a distribution over many
requests rather than read one by one: sampled answers differ from run to run on the same model,
so a candidate is judged by whether its distribution moves away from the baseline's own.

A plug-in: adding a scorer is one small class with a ``name`` and a ``score`` method, and one
line in ``SCORERS``; ``tests/shadow/test_scorers.py`` runs its conformance checks over every
registered scorer.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol


class QualityScorer(Protocol):
    """Compares two answers to the same request: 1.0 alike, 0.0 unlike.

    ``score`` is pure, total (any two strings, empty ones included) and symmetric in spirit;
    equal texts score 1.0. It runs on the event loop, once per scored shadow: linear time."""

    name: str

    def score(self, primary: str, shadow: str) -> float: ...


class ExactMatch:
    """``1.0`` when both answers are the same text once whitespace runs are collapsed, else ``0.0``.

    Why: with greedy decoding (``temperature: 0``) a candidate that serves the same weights
    (a new engine version, another quantisation kernel) should answer token for token alike;
    the share of exact matches is the regression signal."""

    name = "exact"

    def score(self, primary: str, shadow: str) -> float:
        return 1.0 if primary.split() == shadow.split() else 0.0


class WordJaccard:
    """``|A ∩ B| / |A ∪ B|`` over the sets of case-folded words of each answer; ``1.0`` when both are empty.

    Why: sampled or differently phrased answers rarely match exactly, but a candidate that
    answers the same question shares most of its vocabulary; a falling overlap says it drifted."""

    name = "jaccard"

    def score(self, primary: str, shadow: str) -> float:
        a, b = set(primary.casefold().split()), set(shadow.casefold().split())
        union = a | b
        return len(a & b) / len(union) if union else 1.0


class LengthRatio:
    """``min(len(p), len(s)) / max(len(p), len(s))`` in characters; ``1.0`` when both are empty.

    Why: a candidate that rambles or truncates (another chat template, a stop token it ignores)
    shows it first in its answers' lengths, whatever their words."""

    name = "length_ratio"

    def score(self, primary: str, shadow: str) -> float:
        longer = max(len(primary), len(shadow))
        return min(len(primary), len(shadow)) / longer if longer else 1.0


SCORERS: Mapping[str, QualityScorer] = MappingProxyType(
    {
        scorer.name: scorer
        for scorer in (
            ExactMatch(),
            WordJaccard(),
            LengthRatio(),
        )
    }
)
"""Every quality scorer by the name a policy gives it."""


def scorer_problems(name: str) -> list[str]:
    """What is wrong with a policy naming scorer ``name`` (empty when nothing); the policy loader
    prefixes each with the field's path, e.g. ``model_groups[0].shadow.scorer: ...``."""
    if name in SCORERS:
        return []
    return [f"unknown scorer '{name}' (known: {', '.join(sorted(SCORERS))})"]
