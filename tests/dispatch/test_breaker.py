"""The circuit breaker: when it opens, how long it stays open, how a probe closes it.

Scenarios are scripts of steps on a fake clock: ``F`` a request that fails, ``S`` one that
succeeds, ``+30`` thirty seconds pass, ``A`` a request is acquired with no verdict yet, ``R``
it is released without one.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.dispatch.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from tests.fake_clock import FakeClock

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
RATIO_ONLY = {"consecutive_failures": None}


def run(breaker: CircuitBreaker, clock: FakeClock, script: str) -> None:
    for step in script.split():
        if step.startswith("+"):
            clock.advance(float(step[1:]))
        elif step == "A":
            assert breaker.try_acquire()
        elif step == "R":
            breaker.abstain()
        elif breaker.try_acquire():
            breaker.on_failure() if step == "F" else breaker.on_success()


def breaker_for(**overrides: Any) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker("b1", BreakerPolicy(**overrides), clock), clock


@pytest.mark.parametrize(
    ("policy", "script", "state"),
    [
        ({}, "F F F F F", OPEN),
        ({}, "F F F F", CLOSED),
        ({}, "F F F F S F F F F", CLOSED),
        (RATIO_ONLY, "S F " * 10, OPEN),
        (RATIO_ONLY, "F S " * 9 + "S S", CLOSED),
        (RATIO_ONLY, "F S " * 9 + "F", CLOSED),
        (RATIO_ONLY, "F S " * 5 + "+10 " + "F S " * 5, CLOSED),
        ({"consecutive_failures": None, "failure_ratio": None}, "F " * 50, CLOSED),
        ({}, "F F F F F +29.9", OPEN),
        ({}, "F F F F F +30", HALF_OPEN),
        ({}, "F F F F F +30 S", CLOSED),
        ({}, "F F F F F +30 F", OPEN),
        ({}, "F F F F F +30 F +30", OPEN),
        ({}, "F F F F F +30 F +60", HALF_OPEN),
        ({}, "F F F F F +30 S F F F F", CLOSED),
    ],
    ids=[
        "five failures in a row open the breaker",
        "four failures in a row leave it closed",
        "a success resets the run of failures",
        "half of twenty requests failing opens it",
        "nine failures in twenty requests leave it closed",
        "nineteen requests are too few to judge a ratio",
        "failures older than the window are forgotten",
        "with both rules off nothing opens it",
        "it stays open for the whole open interval",
        "after the open interval it is half-open",
        "a probe success closes it",
        "a probe failure opens it again",
        "the second open interval is longer than the first",
        "the second open interval is twice the first",
        "closing starts from fresh counters",
    ],
)
def test_breaker_state_after_a_script(policy: dict[str, Any], script: str, state: BreakerState) -> None:
    breaker, clock = breaker_for(**policy)
    run(breaker, clock, script)
    assert breaker.state is state


@pytest.mark.parametrize(
    ("trips", "interval"),
    [(1, 30), (2, 60), (3, 120), (4, 240), (5, 300), (8, 300)],
    ids=[
        "the first trip opens for open_s",
        "the second doubles it",
        "the third doubles it again",
        "the fourth doubles it again",
        "the fifth is capped at max_open_s",
        "later trips stay at the cap",
    ],
)
def test_open_interval_grows_on_repeated_trips_up_to_the_cap(trips: int, interval: float) -> None:
    breaker, clock = breaker_for()
    run(breaker, clock, "F F F F F")
    for _ in range(trips - 1):
        clock.t = breaker.open_until
        run(breaker, clock, "F")
    assert breaker.trips == trips
    assert breaker.open_until - clock.now() == interval


@pytest.mark.parametrize(
    ("calm_s", "interval"),
    [(299, 60), (300, 30)],
    ids=[
        "a trip soon after recovering continues the streak",
        "a trip after max_open_s of calm starts it again",
    ],
)
def test_the_streak_is_forgotten_after_staying_closed(calm_s: float, interval: float) -> None:
    breaker, clock = breaker_for()
    run(breaker, clock, f"F F F F F +30 S +{calm_s} F F F F F")
    assert breaker.open_until - clock.now() == interval


@pytest.mark.parametrize(
    ("probes", "script", "allowed"),
    [
        (1, "F F F F F +30", True),
        (1, "F F F F F +30 A", False),
        (1, "F F F F F +30 A R", True),
        (2, "F F F F F +30 A", True),
        (2, "F F F F F +30 A A", False),
        (1, "F F F F F +30 A +59", False),
        (1, "F F F F F +30 A +60", True),
    ],
    ids=[
        "half-open lets a probe through",
        "one probe in flight uses the only slot",
        "a released probe frees its slot",
        "two slots let a second probe through",
        "two probes in flight use both slots",
        "a silent probe holds its slot until probe_timeout_s",
        "a silent probe is forgotten after probe_timeout_s",
    ],
)
def test_half_open_lets_at_most_k_probes_through(probes: int, script: str, allowed: bool) -> None:
    breaker, clock = breaker_for(half_open_probes=probes)
    run(breaker, clock, script)
    assert breaker.allow() is allowed
    assert breaker.try_acquire() is allowed


def test_allow_has_no_side_effect_so_filters_may_call_it_freely() -> None:
    breaker, clock = breaker_for()
    run(breaker, clock, "F F F F F +30")
    assert all(breaker.allow() for _ in range(10))
    assert breaker.try_acquire()
    assert not breaker.try_acquire()
    assert breaker.refused == 1


def test_outcomes_of_requests_started_before_the_trip_are_ignored() -> None:
    breaker, clock = breaker_for()
    run(breaker, clock, "A A F F F F F")
    breaker.on_success()
    breaker.on_failure()
    assert breaker.state is OPEN
    assert breaker.trips == 1


def test_transitions_are_reported_to_the_listener() -> None:
    clock = FakeClock()
    seen: list[tuple[str, str, str]] = []
    breaker = CircuitBreaker("b1", BreakerPolicy(), clock, on_transition=lambda n, a, b: seen.append((n, a, b)))
    run(breaker, clock, "F F F F F +30 F +60 S")
    assert seen == [
        ("b1", "closed", "open"),
        ("b1", "open", "half_open"),
        ("b1", "half_open", "open"),
        ("b1", "open", "half_open"),
        ("b1", "half_open", "closed"),
    ]
    assert repr(breaker) == "CircuitBreaker('b1', state=closed, trips=2)"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"open_s": 60, "max_open_s": 30}, "max_open_s must not be less than open_s"),
        ({"failure_ratio": 0}, "greater than 0"),
        ({"failure_ratio": 1.5}, "less than or equal to 1"),
        ({"half_open_probes": 0}, "greater than 0"),
        ({"open_growth": 0.5}, "greater than or equal to 1"),
    ],
    ids=[
        "an unknown key is rejected",
        "a cap below the base interval is rejected",
        "a zero failure ratio is rejected",
        "a failure ratio above one is rejected",
        "zero probes are rejected",
        "a shrinking open interval is rejected",
    ],
)
def test_policy_rejects_bad_values(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BreakerPolicy(**fields)


def test_policy_defaults_are_what_an_envoy_user_expects() -> None:
    policy = BreakerPolicy()
    assert (policy.consecutive_failures, policy.open_s, policy.max_open_s) == (5, 30.0, 300.0)
    assert (policy.failure_ratio, policy.min_requests, policy.window_s) == (0.5, 20, 10.0)
    assert policy.half_open_probes == 1
    assert [s.value for s in BreakerState] == ["closed", "open", "half_open"]
