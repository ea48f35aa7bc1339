"""The routing framework (``gateway/routing/framework.py``): the ``Scorer`` protocol's conformance
suite, the load bound, and how a profile combines scores.

The conformance suite runs over every scorer of ``registry.SCORERS``: a scorer registered later is
checked here without an edit. Each test states one clause of the protocol's docstring. Candidates
are real ``BackendState``s of a parsed policy, loaded through ``reserve`` and given scraped
signals the way the scraper sets them; the tenant-scope clause uses the cycle the real
prefix-affinity router builds. What each scorer's own formula gives is in ``tests/routing/scorers/``.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from gateway.dispatch.backends import BackendPool, BackendState
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.framework import Cycle, Profile, Scorer, Weighted, load_bound
from gateway.routing.prefix_affinity import PrefixAffinityRouter
from gateway.routing.registry import SCORERS, build_routers
from gateway.service import parse_policy
from gateway.types import InferenceRequest, PrefixKeys
from tests.fake_clock import FakeClock
from tests.routing.conftest import (
    MODEL,
    SECRET,
    chat_request,
    counters,
    load,
    routing_policy,
    scoring_cycle,
    states,
    tenant,
)

NOW = 1000.0
FRESH_S = 3.0
BLOCKS = 8
NAN, INF = math.nan, math.inf


@dataclass(frozen=True, slots=True)
class Signals:
    """What a scorer may read about one candidate."""

    requests: int = 0
    tokens_each: int = 100
    waiting: float = 0.0
    kv: float = 0.0
    age_s: float | None = 0.0
    """Seconds since the last scrape; None when it was never scraped."""
    matched: int = 0


IDLE = Signals()
BUSY = Signals(requests=3, waiting=2, kv=0.5, matched=4)


@cache
def snapshot_of(backends: int) -> PolicySnapshot:
    return parse_policy(routing_policy(backends), "t.yaml")


def pool(*signals: Signals) -> list[BackendState]:
    """Fresh backend states carrying ``signals``, one per candidate."""
    out = list(BackendPool(snapshot_of(len(signals))).for_model(MODEL))
    for state, signal in zip(out, signals, strict=True):
        for _ in range(signal.requests):
            state.reserve(0, signal.tokens_each)
        state.waiting, state.kv_usage = signal.waiting, signal.kv
        if signal.age_s is not None:
            state.scraped_at = NOW - signal.age_s
    return out


def request_for(backends: int = 3) -> InferenceRequest:
    return chat_request(snapshot_of(backends), "Where is my order?")


def cycle(request: InferenceRequest, signals: tuple[Signals, ...], blocks: int | None = BLOCKS) -> Cycle:
    """A cycle whose prompt has ``blocks`` full blocks (None: not keyed), matched as ``signals`` say."""
    keys = None if blocks is None else PrefixKeys(7, 16, tuple(range(blocks)))
    matched = [min(s.matched, blocks or 0) for s in signals]
    return Cycle(NOW, FRESH_S, keys, matched, request.prompt_tokens + request.max_tokens)


def scores(scorer: Scorer, *signals: Signals, blocks: int | None = BLOCKS) -> list[float]:
    request = request_for(len(signals))
    return scorer.score(request, pool(*signals), cycle(request, signals, blocks))


POOLS = {
    "an idle pool": (IDLE, IDLE, IDLE),
    "a skewed pool": (Signals(requests=9, waiting=4, kv=0.9, matched=8), Signals(requests=1, matched=3), IDLE),
    "a saturated pool": (Signals(requests=50, tokens_each=4000, waiting=200, kv=1.0, matched=BLOCKS),) * 3,
    "a stale and a never-scraped backend": (
        Signals(waiting=30, kv=0.95, age_s=60),
        Signals(waiting=5, kv=0.5, age_s=None),
        Signals(requests=2, waiting=1, kv=0.2, matched=2),
    ),
    "signals out of their range": (Signals(waiting=-3, kv=1.5), Signals(kv=-0.2, matched=1), BUSY),
    "signals that are not numbers": (Signals(waiting=NAN, kv=NAN), Signals(waiting=INF, kv=INF), Signals(waiting=-INF)),
    "a lone busy backend": (BUSY,),
    "eight mixed backends": tuple(
        Signals(
            requests=i % 4, tokens_each=50 * (i + 1), waiting=i % 3, kv=i / 8, age_s=(0, 60, None)[i % 3], matched=i
        )
        for i in range(8)
    ),
}
POOL_CASES = [pytest.param(signals, id=name) for name, signals in POOLS.items()]


@pytest.fixture(params=sorted(SCORERS))
def scorer(request: pytest.FixtureRequest) -> Scorer:
    """Each registered scorer, made by its factory under its registry name."""
    name: str = request.param
    return SCORERS[name](name)


def observable(candidates: list[BackendState], request: InferenceRequest, cyc: Cycle) -> list[Any]:
    """Everything a scorer could change: the candidates, the request, the cycle."""
    return [*counters(candidates), copy.deepcopy(request.body), request.prefix_keys, cyc.keys, list(cyc.matched)]


def same(a: list[float], b: list[float]) -> bool:
    """Equal, NaN included (a NaN would fail the range test anyway)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def test_a_scorer_carries_the_instance_name_it_was_made_with(scorer: Scorer) -> None:
    assert scorer.name in SCORERS
    assert SCORERS[scorer.name]("tuned").name == "tuned"  # the name its scores are reported under


@pytest.mark.parametrize("signals", POOL_CASES)
def test_every_candidate_gets_one_finite_score_between_zero_and_one(
    scorer: Scorer, signals: tuple[Signals, ...]
) -> None:
    rated = scores(scorer, *signals)
    assert len(rated) == len(signals)
    assert all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in rated), rated


@pytest.mark.parametrize("signals", POOL_CASES)
def test_scoring_changes_nothing_and_gives_the_same_scores_again(scorer: Scorer, signals: tuple[Signals, ...]) -> None:
    request = request_for(len(signals))
    candidates, cyc = pool(*signals), cycle(request, signals)
    before = observable(candidates, request, cyc)
    first = scorer.score(request, candidates, cyc)
    assert observable(candidates, request, cyc) == before
    scorer.score(request_for(), pool(IDLE, BUSY, IDLE), cycle(request_for(), (IDLE, BUSY, IDLE)))  # another pick
    assert same(scorer.score(request, candidates, cyc), first)


@pytest.mark.parametrize("signals", POOL_CASES)
def test_permuting_the_candidates_permutes_the_scores(scorer: Scorer, signals: tuple[Signals, ...]) -> None:
    request = request_for(len(signals))
    candidates = pool(*signals)
    base = scorer.score(request, candidates, cycle(request, signals))
    orders = list(itertools.permutations(range(len(signals))))
    for order in random.Random(len(signals)).sample(orders, min(len(orders), 24)):
        moved = tuple(signals[i] for i in order)
        rated = scorer.score(request, [candidates[i] for i in order], cycle(request, moved))
        assert rated == pytest.approx([base[i] for i in order], rel=1e-12, abs=1e-12), order


@pytest.mark.parametrize(
    "signal",
    [
        pytest.param(IDLE, id="idle"),
        pytest.param(BUSY, id="busy"),
        pytest.param(Signals(requests=2, waiting=7, kv=0.7, age_s=60, matched=2), id="stale"),
        pytest.param(Signals(waiting=NAN, kv=INF, matched=BLOCKS), id="with signals that are not numbers"),
    ],
)
def test_identical_candidates_score_the_same(scorer: Scorer, signal: Signals) -> None:
    rated = scores(scorer, signal, signal, signal)
    assert rated[0] == rated[1] == rated[2]


@pytest.mark.parametrize(
    ("signal", "best"),
    [
        pytest.param(IDLE, False, id="an idle one"),
        pytest.param(Signals(requests=40, tokens_each=2000, waiting=90, kv=1.0), False, id="a saturated one"),
        pytest.param(Signals(waiting=9, kv=0.9, age_s=None), False, id="a never-scraped one"),
        pytest.param(Signals(matched=BLOCKS), True, id="an idle one holding the whole prompt"),
    ],
)
def test_a_lone_candidate_gets_one_score_and_the_best_scores_one(scorer: Scorer, signal: Signals, best: bool) -> None:
    (rated,) = scores(scorer, signal)
    assert 0.0 <= rated <= 1.0
    if best:
        assert rated == 1.0


@pytest.mark.parametrize(
    ("scraped", "idle"),
    [
        pytest.param(Signals(waiting=40, kv=0.9, age_s=FRESH_S + 1), IDLE, id="a scrape older than fresh_s"),
        pytest.param(Signals(waiting=40, kv=0.9, age_s=None), IDLE, id="no scrape yet"),
        pytest.param(Signals(waiting=NAN, kv=NAN), IDLE, id="NaN values"),
        pytest.param(Signals(waiting=INF, kv=INF), IDLE, id="infinite values"),
        pytest.param(Signals(waiting=-INF, kv=-INF), IDLE, id="minus infinite values"),
        pytest.param(Signals(waiting=-3, kv=-0.5), IDLE, id="negative values as zero"),
        pytest.param(Signals(waiting=4, kv=1.7), Signals(waiting=4, kv=1.0), id="KV usage above one as full"),
        pytest.param(
            Signals(waiting=5, kv=0.6, age_s=FRESH_S), Signals(waiting=5, kv=0.6), id="a scrape exactly fresh_s old"
        ),
    ],
)
def test_a_scraped_signal_is_read_as_idle_when_unknown_and_clamped_when_out_of_range(
    scorer: Scorer, scraped: Signals, idle: Signals
) -> None:
    others = (BUSY, Signals(requests=1, waiting=1, kv=0.2))
    assert same(scores(scorer, scraped, *others), scores(scorer, idle, *others))


@pytest.mark.parametrize("signals", [pytest.param(POOLS[n], id=n) for n in ("an idle pool", "a skewed pool")])
def test_a_prompt_without_a_full_block_favours_no_candidate_for_affinity(
    scorer: Scorer, signals: tuple[Signals, ...]
) -> None:
    unkeyed = scores(scorer, *signals, blocks=None)
    assert same(scores(scorer, *signals, blocks=0), unkeyed)
    load_only = Signals(requests=2, waiting=1, kv=0.3)
    assert len(set(scores(scorer, load_only, load_only, load_only, blocks=0))) == 1


def dominates(a: Signals, b: Signals) -> bool:
    """``a`` is no worse than ``b`` on every signal (both fresh: a stale signal reads as idle)."""
    return (
        a.requests <= b.requests
        and a.requests * a.tokens_each <= b.requests * b.tokens_each
        and a.waiting <= b.waiting
        and a.kv <= b.kv
        and a.matched >= b.matched
    )


@pytest.mark.parametrize(
    ("better", "worse"),
    [
        pytest.param(Signals(requests=1), Signals(requests=2), id="one request fewer in flight"),
        pytest.param(Signals(requests=2, tokens_each=50), Signals(requests=2, tokens_each=500), id="fewer tokens"),
        pytest.param(Signals(waiting=0), Signals(waiting=3), id="a shorter engine queue"),
        pytest.param(Signals(kv=0.1), Signals(kv=0.8), id="an emptier KV cache"),
        pytest.param(Signals(matched=6), Signals(matched=2), id="more matched blocks"),
        pytest.param(
            Signals(requests=1, waiting=1, kv=0.2, matched=BLOCKS),
            Signals(requests=5, tokens_each=900, waiting=9, kv=0.9),
            id="better on everything",
        ),
        pytest.param(BUSY, BUSY, id="equal on everything"),
    ],
)
def test_a_candidate_no_worse_on_every_signal_never_scores_lower(
    scorer: Scorer, better: Signals, worse: Signals
) -> None:
    third = Signals(requests=4, tokens_each=300, waiting=2, kv=0.5, matched=3)
    high, low, _ = scores(scorer, better, worse, third)
    assert high >= low
    low, _, high = scores(scorer, worse, third, better)
    assert high >= low


def random_signals(rng: random.Random) -> Signals:
    return Signals(
        requests=rng.randrange(6),
        tokens_each=rng.choice((10, 100, 1000)),
        waiting=rng.randrange(5),
        kv=rng.choice((0.0, 0.25, 0.5, 1.0)),
        matched=rng.randrange(BLOCKS + 1),
    )


def test_across_random_pools_a_dominated_candidate_never_scores_higher(scorer: Scorer) -> None:
    rng = random.Random(20240611)
    pairs = 0
    for _ in range(300):
        signals = tuple(random_signals(rng) for _ in range(4))
        rated = scores(scorer, *signals)
        for (i, a), (j, b) in itertools.permutations(enumerate(signals), 2):
            if dominates(a, b):
                pairs += 1
                assert rated[i] >= rated[j], (a, b, rated)
    assert pairs > 100  # the sweep really compared candidates


def test_an_idle_candidate_holding_the_whole_prompt_scores_one_beside_busier_ones(scorer: Scorer) -> None:
    best = Signals(matched=BLOCKS)
    rated = scores(scorer, BUSY, best, Signals(requests=20, waiting=30, kv=1.0, matched=BLOCKS))
    assert rated[1] == 1.0


def prefix_snapshot() -> PolicySnapshot:
    routing = {"strategy": "prefix_affinity", "block_tokens": 16}
    return parse_policy(routing_policy(models={MODEL: {"routing": routing}}), "t.yaml")


def scores_as_router_sees(
    scorer: Scorer, router: PrefixAffinityRouter, snapshot: PolicySnapshot, who: str, candidates: list[BackendState]
) -> tuple[list[float], Cycle]:
    """The scores of ``who``'s prompt from the cycle the real router builds for that tenant."""
    request = chat_request(snapshot, "Where is my order?")
    cyc = router.cycle(request, router.keys(request, tenant(snapshot, who)), candidates)
    return scorer.score(request, candidates, cyc), cyc


def prefix_router(snapshot: PolicySnapshot) -> PrefixAffinityRouter:
    router = build_routers(snapshot, FakeClock(NOW), SECRET)[MODEL]
    assert isinstance(router, PrefixAffinityRouter)
    return router


@pytest.mark.parametrize(
    ("teacher", "asker", "shared"),
    [
        pytest.param("acme", "globex", False, id="another tenant's cached prefix is not seen"),
        pytest.param("shared-a", "shared-b", True, id="a shared cache scope's prefix is seen as the tenant's own"),
    ],
)
def test_a_scorer_rates_only_prefixes_cached_under_the_requests_tenant_scope(
    scorer: Scorer, teacher: str, asker: str, shared: bool
) -> None:
    snapshot = prefix_snapshot()
    router, candidates = prefix_router(snapshot), states(snapshot)
    taught = chat_request(snapshot, "Where is my order?")
    router.on_dispatch(taught, tenant(snapshot, teacher), router.pick(taught, tenant(snapshot, teacher), candidates))
    own, own_cycle = scores_as_router_sees(scorer, router, snapshot, teacher, candidates)
    assert max(own_cycle.matched) > 0, "the router learnt nothing: the test would prove nothing"
    asked, _ = scores_as_router_sees(scorer, router, snapshot, asker, candidates)
    untaught, _ = scores_as_router_sees(scorer, prefix_router(snapshot), snapshot, asker, candidates)
    assert asked == (own if shared else untaught)


# The framework's own arithmetic: the load bound, and the profile's combination of scores


@pytest.mark.parametrize(
    ("loads", "epsilon", "bound"),
    [
        pytest.param([0, 0, 0], 0.25, 1, id="an idle pool allows one request each"),
        pytest.param([10, 10, 10], 0.25, 13, id="a balanced pool allows a quarter above the average"),
        pytest.param([30, 0, 0], 0.0, 11, id="epsilon zero allows the rounded-up average"),
    ],
)
def test_the_load_bound_is_ceil_one_plus_epsilon_times_the_average_after_this_request(
    snapshot: PolicySnapshot, loads: list[int], epsilon: float, bound: int
) -> None:
    candidates = [load(s, n) for s, n in zip(states(snapshot), loads, strict=True)]
    assert load_bound(candidates, epsilon) == bound


class _Fixed:
    def __init__(self, name: str, scores: list[float]) -> None:
        self.name = name
        self._scores = scores

    def score(self, request: object, candidates: object, cycle: object) -> list[float]:
        return self._scores


def test_the_profile_clamps_weighs_and_normalises_scores(snapshot: PolicySnapshot) -> None:
    profile = Profile([Weighted(_Fixed("x", [2.0, -1.0, 0.5]), 3), Weighted(_Fixed("y", [0, 1, 1]), 1)])
    scored = profile.run(chat_request(snapshot, "Hi"), states(snapshot), scoring_cycle([0, 0, 0]))
    assert scored.by_scorer["x"] == [1.0, 0.0, 0.5]
    assert scored.totals == pytest.approx([0.75, 0.25, 0.625])


def test_a_profile_without_a_positive_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one scorer"):
        Profile([Weighted(_Fixed("x", []), 0)])


def test_the_profile_counts_a_score_that_is_not_a_number_as_zero(snapshot: PolicySnapshot) -> None:
    nan, inf = float("nan"), float("inf")
    profile = Profile([Weighted(_Fixed("x", [nan, inf, -inf]), 1)])
    scored = profile.run(chat_request(snapshot, "Hi"), states(snapshot), scoring_cycle([0, 0, 0]))
    assert scored.by_scorer["x"] == [0.0, 1.0, 0.0]
    assert scored.totals == [0.0, 1.0, 0.0]
