"""Wald's sequential probability ratio test of a canary step, one per signal.

The setting. During a step the canary sends each request of the two arms {baseline, candidate}
to the candidate with probability ``pi`` (the step's percent / 100), at random and independently
of the request. For a *signal* (errors, refusals, SLO misses, slow TTFT, slow ITL) a request is
either a bad event or not. Condition on the bad events only: each one came from the candidate

* with probability ``pi`` under H0 (the candidate's bad events are as likely as the baseline's:
  randomised assignment makes the arms exchangeable, whatever the traffic and its bad rate do);
* with probability ``pi' = pi*r / (pi*r + 1 - pi)`` under H1 (the candidate's are ``r`` times as
  likely; ``r`` is ``CanaryTest.relative_risk``).

The test. After ``c`` bad events of the candidate and ``b`` of the baseline, Wald's log
likelihood ratio (Wald, "Sequential tests of statistical hypotheses", Ann. Math. Statist. 16,
1945) is::

    LLR = c*ln(pi'/pi) + b*ln((1-pi')/(1-pi)) = c*ln(r) - (c+b)*ln(1 + pi*(r-1))

It depends on the counts only, not on their order, so the sums of the counts that several
processes tally (``judge.Tally``) give the same statistic as one process seeing everything.

The guarantee. Under H0 the likelihood ratio ``exp(LLR)`` is a nonnegative martingale with
mean 1, so by Ville's inequality (Ville, "Étude critique de la notion de collectif", 1939)
``P(sup_t LLR_t >= ln(1/a)) <= a``: however long the step is watched and however often it is
looked at, a candidate as good as the baseline crosses ``ln(1/a)`` with probability at most
``a``. The rollout runs one fresh test per signal and per judged step (every step but the last,
100), so it rolls back at::

    threshold = ln(len(SIGNALS) * judged_steps / alpha)

and the union bound (Bonferroni) bounds the chance that a candidate as good as the baseline is
ever rolled back, at any step, on any signal, by ``alpha``. There is no early acceptance
boundary: a step is promoted on time and volume (``judge.judge``), not on evidence of H0.

What it costs. The expected number of bad events to cross is about ``threshold / KL`` with
``KL = q*ln(r) - ln(1 + pi*(r-1))`` the mean step of the LLR when the candidate's true share of
the bad events is ``q``; a small ``pi`` makes each candidate bad event strong evidence but
makes them rare. What the test is blind to: a bad signal in both arms at once (the baseline is
the control, not an absolute bar) and bad events that are not independent of the assignment.
"""

from __future__ import annotations

import math

from gateway.policy.groups import CanaryTest

SIGNALS: tuple[str, ...] = ("errors", "refusals", "slo_misses", "slow_ttft", "slow_itl")
"""The bad events a canary watches; each has its own test, and the threshold pays for all of them."""


def log_likelihood_ratio(candidate_bad: int, baseline_bad: int, share: float, relative_risk: float) -> float:
    """``ln`` of the likelihood of H1 ("the candidate's bad events are ``relative_risk`` times as
    likely") over H0 ("as likely") given the bad events of each arm, at candidate share ``share``.

    Positive when the candidate has more than its share of the bad events. A share of 0 or 1 leaves
    one arm empty, so the counts carry no information and the ratio is 0.
    """
    if candidate_bad < 0 or baseline_bad < 0:
        raise ValueError("counts cannot be negative")
    if relative_risk <= 0:
        raise ValueError("relative_risk must be positive")
    if not 0.0 < share < 1.0:
        return 0.0
    return candidate_bad * math.log(relative_risk) - (candidate_bad + baseline_bad) * math.log1p(
        share * (relative_risk - 1.0)
    )


def rollback_threshold(test: CanaryTest, judged_steps: int) -> float:
    """The LLR at which a signal rolls the candidate back: ``ln(len(SIGNALS) * judged_steps / alpha)``.

    Each of the ``len(SIGNALS) * judged_steps`` tests then wrongly fires with probability at most
    ``alpha / (len(SIGNALS) * judged_steps)`` (Ville), so all of them together at most ``alpha``.
    """
    if judged_steps < 1:
        raise ValueError("a rollout judges at least one step")
    return math.log(len(SIGNALS) * judged_steps / test.alpha)
