"""Cost attribution on numbers that are exact in binary: $3,600 an hour is $1 a second."""

from __future__ import annotations

import pytest

from gateway.telemetry.cost import CostAccountant, CostKey, CostTotal, split_cost

ACME_CHAT = CostKey("acme", "chat", "interactive")
GLOBEX_CHAT = CostKey("globex", "chat", "batch")
ACME_OTHER = CostKey("acme", "other", "interactive")


@pytest.mark.parametrize(
    ("cost", "weights", "expected"),
    [
        (8.0, [("a", 1), ("b", 3)], {"a": 2.0, "b": 6.0}),
        (8.0, [("a", 1), ("a", 1), ("b", 2)], {"a": 4.0, "b": 4.0}),
        (6.0, [("a", 0), ("b", 0), ("c", 0)], {"a": 2.0, "b": 2.0, "c": 2.0}),
        (6.0, [], {}),
    ],
    ids=[
        "shares follow tokens",
        "a key named twice adds its shares",
        "zero tokens everywhere split equally",
        "no requests take no share",
    ],
)
def test_split_cost(cost: float, weights: list[tuple[str, int]], expected: dict[str, float]) -> None:
    assert split_cost(cost, weights) == expected


def test_an_interval_is_split_over_its_requests_by_tokens_idle_time_included() -> None:
    costs = CostAccountant({"b1": 3600.0}, now=100.0)
    costs.add_request(backend="b1", key=ACME_CHAT, tokens=100, goodput=True)
    costs.add_request(backend="b1", key=GLOBEX_CHAT, tokens=300, goodput=False)
    deltas = costs.close_interval(108.0)  # 8 s at $1/s, however busy the backend was
    assert deltas == {ACME_CHAT: CostTotal(2.0, 1, 1, 100), GLOBEX_CHAT: CostTotal(6.0, 1, 0, 300)}
    assert costs.totals == deltas


def test_the_same_requests_cost_more_when_the_backend_idled_longer() -> None:
    busy = CostAccountant({"b1": 3600.0}, now=0.0)
    idle = CostAccountant({"b1": 3600.0}, now=0.0)
    for costs in (busy, idle):
        costs.add_request(backend="b1", key=ACME_CHAT, tokens=50, goodput=True)
    busy.close_interval(1.0)
    idle.close_interval(4.0)
    assert busy.totals[ACME_CHAT].per_goodput_request == 1.0
    assert idle.totals[ACME_CHAT].per_goodput_request == 4.0


def test_each_backend_charges_its_own_price_to_its_own_requests() -> None:
    costs = CostAccountant({"cheap": 1800.0, "dear": 7200.0}, now=0.0)
    costs.add_request(backend="cheap", key=ACME_CHAT, tokens=10, goodput=True)
    costs.add_request(backend="dear", key=ACME_CHAT, tokens=10, goodput=True)
    costs.add_request(backend="dear", key=ACME_OTHER, tokens=30, goodput=True)
    costs.close_interval(2.0)
    assert costs.totals[ACME_CHAT] == CostTotal(1.0 + 1.0, 2, 2, 20)
    assert costs.totals[ACME_OTHER] == CostTotal(3.0, 1, 1, 30)


def test_an_interval_without_requests_is_kept_as_unattributed_and_charged_to_no_one() -> None:
    costs = CostAccountant({"b1": 3600.0, "b2": 3600.0}, now=0.0)
    costs.add_request(backend="b1", key=ACME_CHAT, tokens=1, goodput=True)
    assert costs.close_interval(4.0) == {ACME_CHAT: CostTotal(4.0, 1, 1, 1)}
    assert costs.last_unattributed == {"b2": 4.0}
    assert costs.close_interval(6.0) == {}
    assert costs.last_unattributed == {"b1": 2.0, "b2": 2.0}
    assert costs.unattributed == {"b1": 2.0, "b2": 6.0}


def test_requests_that_carried_no_tokens_split_the_interval_equally() -> None:
    costs = CostAccountant({"b1": 3600.0}, now=0.0)
    for _ in range(3):
        costs.add_request(backend="b1", key=ACME_CHAT, tokens=0, goodput=False)
    costs.add_request(backend="b1", key=GLOBEX_CHAT, tokens=0, goodput=False)
    costs.close_interval(8.0)
    assert (costs.totals[ACME_CHAT].dollars, costs.totals[GLOBEX_CHAT].dollars) == (6.0, 2.0)
    assert costs.totals[ACME_CHAT].per_goodput_request is None


def test_a_backend_without_a_price_serves_for_free() -> None:
    costs = CostAccountant({}, now=0.0)
    costs.add_request(backend="own-hardware", key=ACME_CHAT, tokens=10, goodput=True)
    costs.close_interval(10.0)
    assert costs.totals[ACME_CHAT] == CostTotal(0.0, 1, 1, 10)
    assert costs.unattributed == {}


def test_new_prices_apply_from_the_moment_they_are_set() -> None:
    costs = CostAccountant({"b1": 3600.0}, now=0.0)
    costs.add_request(backend="b1", key=ACME_CHAT, tokens=1, goodput=True)
    costs.set_prices({"b1": 7200.0}, now=2.0)  # the first 2 s at $1/s
    costs.add_request(backend="b1", key=ACME_CHAT, tokens=1, goodput=True)
    costs.close_interval(3.0)  # the next 1 s at $2/s
    assert costs.totals[ACME_CHAT] == CostTotal(4.0, 2, 2, 2)


def test_totals_roll_up_per_class_and_give_cost_per_goodput_request() -> None:
    costs = CostAccountant({"b1": 3600.0}, now=0.0)
    costs.add_request(backend="b1", key=ACME_CHAT, tokens=100, goodput=True)
    costs.add_request(backend="b1", key=ACME_OTHER, tokens=100, goodput=False)
    costs.add_request(backend="b1", key=GLOBEX_CHAT, tokens=200, goodput=True)
    costs.close_interval(8.0)
    per_class = costs.by(class_name=True)
    interactive = per_class[CostKey("*", "*", "interactive")]
    assert interactive == CostTotal(4.0, 2, 1, 200)
    assert (interactive.per_request, interactive.per_goodput_request) == (2.0, 4.0)
    assert per_class[CostKey("*", "*", "batch")].per_goodput_request == 4.0
    assert costs.by(class_name=False, tenant=True)[CostKey("acme", "*", "*")].dollars == 4.0
