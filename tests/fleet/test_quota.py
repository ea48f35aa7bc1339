"""The parts of a backend's capacity a process may hold when it cannot ask the ledger."""

from __future__ import annotations

import pytest

from gateway.dispatch.quota import Quota, Share
from gateway.fleet.quota import at_most, fallback, partition
from gateway.policy.model import Capacity, PriorityClass, Slo

CAPACITY = Capacity(max_concurrent=10, max_tokens_in_flight=1000)
SLO = Slo(ttft_ms=500, itl_ms=30, e2e_ms=60000)
CLASSES = {
    "interactive": PriorityClass(rank=0, slo=SLO),
    "batch": PriorityClass(rank=1, slo=SLO, max_share=0.5, max_prefilling=3),
}


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        pytest.param(
            1, Quota(10, 1000, {1: 3}, {1: Share(5, 500)}, whole=True), id="one process holds the whole capacity"
        ),
        pytest.param(
            2,
            Quota(5, 500, {1: 1}, {1: Share(2, 250)}),
            id="two workers take half each, prefills and shares rounded down",
        ),
        pytest.param(
            3,
            Quota(3, 333, {1: 1}, {1: Share(1, 166)}),
            id="three take a third each, rounded down: the sum stays within",
        ),
        pytest.param(
            20, Quota(0, 50, {1: 0}, {1: Share(0, 25)}), id="more processes than requests: a share may be nothing"
        ),
    ],
)
def test_a_partition_is_an_equal_share_rounded_down(parts: int, expected: Quota) -> None:
    quota = partition(CAPACITY, CLASSES, parts)
    assert quota == expected
    assert quota.requests * parts <= CAPACITY.max_concurrent
    assert quota.tokens * parts <= CAPACITY.max_tokens_in_flight
    assert quota.shares[1].requests * parts <= 5, "the batch share (0.5 x 10 requests) holds across the parts"
    assert quota.shares[1].tokens * parts <= 500, "and so does its token share"


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        pytest.param(
            None, Quota(2, 250, {1: 0}, {1: Share(1, 125)}), id="never synced: a share of the processes assumed"
        ),
        pytest.param(Quota(8, 800, {1: 3}), Quota(8, 800, {1: 3}), id="a large grant is kept: the others hold less"),
        pytest.param(Quota(1, 100, {1: 0}), Quota(1, 100, {1: 0}), id="a small grant is kept: it never grows"),
    ],
)
def test_the_fallback_is_the_last_grant_frozen(last: Quota | None, expected: Quota) -> None:
    assert fallback(last, CAPACITY, CLASSES, unknown=4) == expected


def test_a_grant_while_the_fleet_re_forms_stays_within_the_frozen_part() -> None:
    grant = Quota(10, 1000, {1: 3}, {1: Share(5, 500)}, whole=True)
    frozen = Quota(4, 900, {1: 1}, {1: Share(2, 600)})
    assert at_most(grant, frozen) == Quota(4, 900, {1: 1}, {1: Share(2, 500)})
