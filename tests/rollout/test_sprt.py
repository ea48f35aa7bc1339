"""The canary's sequential test: its statistic, its threshold, and, by simulation, its two errors.

What a slower candidate needs at ``pi = 0.1`` (10 % of the two arms' traffic on the candidate),
with the default test (``alpha = 0.05``, ``relative_risk = 2``, ``slow_quantile = 0.9``) and the
default steps (1, 5, 25, 50, 100: 4 judged steps, so the rollback threshold is
``ln(5 * 4 / 0.05) = ln 400 = 5.99``):

* Each slow event of the candidate adds ``ln 2 - ln 1.1 = +0.598`` to the LLR, each of the
  baseline adds ``-ln 1.1 = -0.095``.
* A candidate with *twice the baseline's share of slow requests* (the design point: 18.2 % of
  its requests above the pooled p90 against the baseline's 9.1 %) gets 18.2 % of the slow events
  instead of 10 %, a mean of +0.031 per slow event: about 195 slow events, so about 1,950
  requests of the two arms (195 on the candidate), to cross 5.99 (Wald's approximation);
  simulated: median about 1,800, 9 in 10 within about 3,300.
* A candidate *every request of which is 2x slower* (TTFT log-normal with sigma 1) has 25 % of
  its requests above the pooled p90 against the baseline's 8.4 % (a relative risk near 3): a
  mean of +0.076 per slow event, about 80 slow events, about 800 requests (80 on the candidate);
  with sigma 0.5 (a tighter distribution) the relative risk is near 7 and about 300 requests do.
* A candidate exactly as good as the baseline is rolled back, at any step on any signal, with
  probability at most 0.05 however long it is watched.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from gateway.policy.groups import CanaryTest
from gateway.rollout.judge import Observation, Tally
from gateway.rollout.sprt import SIGNALS, log_likelihood_ratio, rollback_threshold

DEFAULT = CanaryTest()
ROLLOUT_THRESHOLD = rollback_threshold(DEFAULT, judged_steps=4)
SIMULATIONS = 2_000


def allowed(level: float, runs: int) -> float:
    """``level`` plus three standard errors of a fraction estimated from ``runs`` Bernoulli runs."""
    return level + 3 * math.sqrt(level * (1 - level) / runs)


def wald_bad_events(share: float, true_candidate_share: float, threshold: float, relative_risk: float = 2.0) -> float:
    """Wald's approximation of the bad events needed to cross: threshold / mean LLR step."""
    drift = true_candidate_share * math.log(relative_risk) - math.log1p(share * (relative_risk - 1))
    return threshold / drift


def candidate_share_of_bad(share: float, risk: float) -> float:
    return share * risk / (share * risk + 1 - share)


@pytest.mark.parametrize(
    ("candidate_bad", "baseline_bad", "share", "sign"),
    [
        pytest.param(0, 0, 0.1, 0, id="no bad events are no evidence"),
        pytest.param(5, 0, 0.1, 1, id="bad events only on the candidate point to the candidate"),
        pytest.param(0, 50, 0.1, -1, id="bad events only on the baseline point away from it"),
        pytest.param(1, 9, 0.1, -1, id="exactly the candidate's share of the bad events points away from it"),
        pytest.param(3, 9, 0.1, 1, id="three times its share points to the candidate"),
        pytest.param(50, 50, 0.5, -1, id="an even split at half the traffic points away from it"),
        pytest.param(70, 30, 0.5, 1, id="70 of 100 at half the traffic points to it"),
    ],
)
def test_the_sign_of_the_evidence(candidate_bad: int, baseline_bad: int, share: float, sign: int) -> None:
    llr = log_likelihood_ratio(candidate_bad, baseline_bad, share, 2.0)
    assert (llr > 0) - (llr < 0) == sign


def test_it_is_walds_ratio_of_the_two_shares() -> None:
    share, risk = 0.05, 3.0
    alt = candidate_share_of_bad(share, risk)
    expected = 7 * math.log(alt / share) + 40 * math.log((1 - alt) / (1 - share))
    assert log_likelihood_ratio(7, 40, share, risk) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("share", [0.01, 0.1, 0.5, 0.9])
def test_more_candidate_bad_events_raise_it_and_more_baseline_ones_lower_it(share: float) -> None:
    by_candidate = [log_likelihood_ratio(c, 10, share, 2.0) for c in range(20)]
    by_baseline = [log_likelihood_ratio(3, b, share, 2.0) for b in range(20)]
    assert all(a < b for a, b in itertools.pairwise(by_candidate))
    assert all(a > b for a, b in itertools.pairwise(by_baseline))


@pytest.mark.parametrize("share", [0.0, 1.0, -0.5, 1.5], ids=lambda s: f"share {s}")
def test_a_share_with_an_empty_arm_carries_no_information(share: float) -> None:
    assert log_likelihood_ratio(12, 3, share, 2.0) == 0.0


def test_negative_counts_and_risks_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        log_likelihood_ratio(-1, 0, 0.1, 2.0)
    with pytest.raises(ValueError, match="relative_risk"):
        log_likelihood_ratio(1, 0, 0.1, 0.0)


def test_the_threshold_pays_for_every_signal_and_every_judged_step() -> None:
    assert rollback_threshold(DEFAULT, 4) == pytest.approx(math.log(len(SIGNALS) * 4 / 0.05))
    assert rollback_threshold(DEFAULT, 4) == pytest.approx(math.log(400))
    assert rollback_threshold(DEFAULT, 8) > rollback_threshold(DEFAULT, 4)
    assert rollback_threshold(CanaryTest(alpha=0.01), 4) > rollback_threshold(DEFAULT, 4)
    with pytest.raises(ValueError, match="at least one"):
        rollback_threshold(DEFAULT, 0)


def ever_crosses_under_h0(rng: random.Random, share: float, bad_rate: float, requests: int, threshold: float) -> bool:
    """One step of ``requests`` requests, both arms bad with probability ``bad_rate``; the LLR is
    looked at after every bad event (the supremum, not only the interval ends); the LLR is a sum of
    one term per bad event, as ``test_it_is_walds_ratio_of_the_two_shares`` checks."""
    up, down = log_likelihood_ratio(1, 0, share, 2.0), log_likelihood_ratio(0, 1, share, 2.0)
    llr = 0.0
    for _ in range(requests):
        u = rng.random()
        if u < share * bad_rate:
            llr += up
            if llr >= threshold:
                return True
        elif u < bad_rate:
            llr += down
    return False


@pytest.mark.parametrize("share", [0.1, 0.5])
@pytest.mark.parametrize("level", [0.05, 0.2])
def test_under_h0_one_test_ever_crosses_ln_1_over_a_at_most_a_of_the_time(share: float, level: float) -> None:
    """Ville's inequality on the bare test: 2,000 steps of 1,000 requests with equal bad rates
    (20 %, so about 200 bad events each), watched after every bad event."""
    rng = random.Random(1945)
    crossed = sum(ever_crosses_under_h0(rng, share, 0.2, 1_000, math.log(1 / level)) for _ in range(SIMULATIONS))
    assert crossed / SIMULATIONS <= allowed(level, SIMULATIONS)


def test_under_h0_a_rollout_is_rolled_back_at_most_alpha_of_the_time() -> None:
    """2,000 rollouts of a candidate as good as the baseline through steps 1, 5, 25, 50 %, five
    independent signals each, 1,000 requests per step with a 20 % bad rate, at the rollout's
    threshold; alpha is raised to 0.3 so that the bound is not trivially met."""
    test = CanaryTest(alpha=0.3)
    threshold = rollback_threshold(test, judged_steps=4)
    rng = random.Random(1939)
    rolled_back = 0
    for _ in range(SIMULATIONS):
        rolled_back += any(
            ever_crosses_under_h0(rng, percent / 100, 0.2, 1_000, threshold)
            for percent in (1, 5, 25, 50)
            for _signal in SIGNALS
        )
    assert rolled_back / SIMULATIONS <= allowed(test.alpha, SIMULATIONS)


def requests_to_cross(rng: random.Random, share: float, baseline_rate: float, risk: float, limit: int) -> int:
    """Requests until the default test rolls back a candidate ``risk`` times as bad (``limit`` if never)."""
    up, down = log_likelihood_ratio(1, 0, share, 2.0), log_likelihood_ratio(0, 1, share, 2.0)
    llr = 0.0
    for n in range(1, limit + 1):
        candidate = rng.random() < share
        if rng.random() < baseline_rate * (risk if candidate else 1.0):
            llr += up if candidate else down
            if llr >= ROLLOUT_THRESHOLD:
                return n
    return limit


@pytest.mark.parametrize(
    ("share", "baseline_rate", "risk"),
    [
        pytest.param(0.1, 0.02, 3.0, id="3x the errors at 10 percent"),
        pytest.param(0.5, 0.02, 3.0, id="3x the errors at 50 percent"),
        pytest.param(0.1, 0.1 / 1.1, 2.0, id="twice the slow requests at 10 percent"),
    ],
)
def test_under_h1_the_test_crosses_within_a_bounded_number_of_requests(
    share: float, baseline_rate: float, risk: float
) -> None:
    """Of 200 runs, the median crosses near Wald's expected number of requests, 19 in 20 within 2.5x
    of it and every one within 10x (the design point, where the truth is exactly H1, has the widest
    spread: one run in 200 needs about 5x)."""
    bad_per_request = share * baseline_rate * risk + (1 - share) * baseline_rate
    expected = wald_bad_events(share, candidate_share_of_bad(share, risk), ROLLOUT_THRESHOLD) / bad_per_request
    limit = int(10 * expected)
    rng = random.Random(3)
    runs = sorted(requests_to_cross(rng, share, baseline_rate, risk, limit) for _ in range(200))
    assert runs[-1] < limit
    assert runs[189] <= 2.5 * expected
    assert 0.7 * expected <= statistics.median(runs) <= 1.2 * expected


def test_the_design_point_figures_in_the_module_docstring() -> None:
    share, alt = 0.1, candidate_share_of_bad(0.1, 2.0)
    assert log_likelihood_ratio(1, 0, share, 2.0) == pytest.approx(0.598, abs=1e-3)
    assert log_likelihood_ratio(0, 1, share, 2.0) == pytest.approx(-0.095, abs=1e-3)
    assert alt == pytest.approx(0.182, abs=1e-3)
    assert wald_bad_events(share, alt, ROLLOUT_THRESHOLD) == pytest.approx(195, abs=1)


@pytest.mark.parametrize(
    ("sigma", "median_at_most", "all_within"),
    [
        pytest.param(1.0, 1_200, 4_000, id="log-normal sigma 1: about 800 requests"),
        pytest.param(0.5, 500, 1_500, id="log-normal sigma 0.5: about 300 requests"),
    ],
)
def test_a_candidate_twice_as_slow_at_10_percent_is_caught_through_the_tally(
    sigma: float, median_at_most: int, all_within: int
) -> None:
    """End to end on slow TTFT: intervals of 100 requests flushed at the pooled p90, counts summed."""
    rng = random.Random(2)

    def one_run() -> int:
        tally, candidate_slow, baseline_slow = Tally(), 0, 0
        for n in range(100, 100 * all_within, 100):
            for _ in range(100):
                candidate = rng.random() < 0.1
                ttft = rng.lognormvariate(math.log(0.3), sigma) * (2.0 if candidate else 1.0)
                tally.add(Observation(candidate, "interactive", False, False, True, ttft, None))
            counts = tally.flush(DEFAULT.slow_quantile)
            candidate_slow += counts.get("candidate:slow_ttft", 0)
            baseline_slow += counts.get("baseline:slow_ttft", 0)
            if log_likelihood_ratio(candidate_slow, baseline_slow, 0.1, 2.0) >= ROLLOUT_THRESHOLD:
                return n
        return 100 * all_within

    runs = [one_run() for _ in range(100)]
    assert max(runs) <= all_within
    assert statistics.median(runs) <= median_at_most
