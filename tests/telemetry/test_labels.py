"""Tenant labels: the busiest keep their names, the rest fold into `other`, without flapping."""

from __future__ import annotations

import pytest

from gateway.telemetry.labels import OTHER, TenantLabels
from tests.fake_clock import FakeClock


def labels(top: int = 2, **kwargs: float) -> tuple[TenantLabels, FakeClock]:
    clock = FakeClock()
    return TenantLabels(top=top, clock=clock, half_life_s=60, refresh_s=10, **kwargs), clock  # type: ignore[arg-type]


def send(tl: TenantLabels, tenant: str, count: int) -> str:
    label = ""
    for _ in range(count):
        label = tl.label(tenant)
    return label


def test_the_first_tenants_fill_the_free_slots_and_the_next_fold_into_other() -> None:
    tl, _ = labels(top=2)
    assert [tl.label(t) for t in ("a", "b", "c", "a", "c")] == ["a", "b", OTHER, "a", OTHER]


def test_an_unauthenticated_request_keeps_its_dash() -> None:
    tl, _ = labels(top=0)
    assert tl.label("-") == "-"
    assert tl.label("a") == OTHER


def test_a_much_busier_tenant_takes_the_weakest_slot_at_the_next_refresh() -> None:
    tl, clock = labels(top=2)
    send(tl, "a", 10)
    send(tl, "b", 2)
    assert send(tl, "c", 20) == OTHER  # between refreshes the members do not change
    clock.advance(10)
    assert tl.label("c") == "c"
    assert tl.members == {"a", "c"}
    assert tl.label("b") == OTHER


def test_a_challenger_within_the_hysteresis_margin_does_not_displace_a_member() -> None:
    tl, clock = labels(top=1)
    send(tl, "a", 10)
    send(tl, "b", 12)  # 20% more than a, under the 25% margin
    for _ in range(5):
        clock.advance(10)
        assert tl.label("a") == "a"
        send(tl, "b", 1)  # b stays a little ahead at every refresh
    assert tl.members == {"a"}


def test_a_tenant_that_went_quiet_loses_its_slot_as_its_count_decays() -> None:
    tl, clock = labels(top=1)
    send(tl, "a", 100)
    clock.advance(600)  # ten half-lives: a's 100 requests now weigh about 0.1
    assert tl.score("a") == pytest.approx(100 / 1024)
    assert tl.label("b") == "b"
    assert tl.members == {"b"}


def test_scores_stay_exact_across_a_renormalisation() -> None:
    tl, clock = labels(top=1)
    send(tl, "a", 8)
    clock.advance(60 * 70)  # past the renormalisation exponent
    send(tl, "b", 3)
    assert tl.score("b") == pytest.approx(3)
    assert tl.score("a") == pytest.approx(8 / 2**70, abs=1e-12)


def test_the_tracked_set_is_bounded() -> None:
    tl, clock = labels(top=2, max_tracked=10)
    for i in range(50):
        tl.label(f"t{i}")
    clock.advance(10)
    tl.label("t0")
    assert len(tl._scores) <= 10


@pytest.mark.parametrize(
    "kwargs",
    [{"half_life_s": 0}, {"refresh_s": -1}, {"hysteresis": 0.5}, {"max_tracked": 1}],
    ids=["a zero half-life", "a negative refresh", "a hysteresis under one", "fewer tracked than labelled"],
)
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="top"):
        TenantLabels(top=2, clock=FakeClock(), **kwargs)  # type: ignore[arg-type]
