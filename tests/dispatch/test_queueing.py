"""Start-time fair queuing within a class, lazy removal, and the drain meter."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.dialects.chat import CHAT
from gateway.dispatch.queueing import ClassQueue, DrainMeter, Ticket
from gateway.policy.model import PriorityClass, Slo, Tenant
from gateway.types import InferenceRequest

CLASS = PriorityClass(rank=0, slo=Slo(ttft_ms=500, itl_ms=30, e2e_ms=1000))


def ticket(tenant: str, cost: int = 100, weight: float = 1.0) -> Ticket:
    request = InferenceRequest("id", CHAT, "m", {}, b"", False, False, 10, cost - 10, 0.0)
    owner = Tenant(name=tenant, key_hashes=["sha256:" + "0" * 64], models=["*"], default_class="i", weight=weight)
    return Ticket(request, owner, cost, 0.0, asyncio.get_running_loop().create_future())


def drain(queue: ClassQueue, n: int) -> list[str]:
    order = []
    for _ in range(n):
        head = queue.peek()
        assert head is not None
        queue.pop(head)
        order.append(head.tenant_name)
    return order


async def test_a_heavy_tenant_cannot_starve_a_light_one() -> None:
    queue = ClassQueue("interactive", CLASS)
    for _ in range(10):
        queue.push(ticket("heavy"))
    queue.push(ticket("light"))
    queue.push(ticket("light"))
    order = drain(queue, 4)
    assert order.count("light") == 2, order


async def test_tenants_share_in_proportion_to_their_weights() -> None:
    queue = ClassQueue("interactive", CLASS)
    for _ in range(30):
        queue.push(ticket("gold", weight=2.0))
        queue.push(ticket("bronze", weight=1.0))
    served = Counter(drain(queue, 30))
    assert served["gold"] == pytest.approx(2 * served["bronze"], abs=2)


async def test_fairness_is_on_tokens_not_requests() -> None:
    queue = ClassQueue("interactive", CLASS)
    for _ in range(20):
        queue.push(ticket("big", cost=1000))
        queue.push(ticket("small", cost=100))
    served = Counter(drain(queue, 22))
    assert served["small"] >= 9 * served["big"] - 2, served


async def test_removed_tickets_leave_the_depth_at_once_and_are_skipped() -> None:
    queue = ClassQueue("interactive", CLASS)
    first, second, third = ticket("a"), ticket("a"), ticket("b")
    for t in (first, second, third):
        queue.push(t)
    queue.remove(first)
    queue.remove(first)  # idempotent
    assert queue.depth == 2
    assert drain(queue, 2) == ["b", "a"]  # b's start tag 0 is before a's second ticket's 100
    assert queue.depth == 0
    assert queue.peek() is None


async def test_an_emptied_queue_forgets_history() -> None:
    queue = ClassQueue("interactive", CLASS)
    for _ in range(5):
        queue.push(ticket("old"))
    drain(queue, 5)
    queue.push(ticket("old"))
    queue.push(ticket("new"))
    assert drain(queue, 2)[0] == "old"


@pytest.mark.parametrize(
    ("times", "now", "expected"),
    [
        pytest.param([], 10.0, None, id="no dispatches means no estimate"),
        pytest.param([1.0, 2.0, 3.0], 4.0, None, id="too few dispatches means no estimate"),
        pytest.param([0.0, 1.0, 2.0, 3.0, 4.0], 4.0, 5 / 4, id="five dispatches in four seconds"),
        pytest.param([0.0, 1.0, 2.0, 3.0, 4.0], 30.0, None, id="old dispatches leave the window"),
    ],
)
def test_drain_rate(times: list[float], now: float, expected: float | None) -> None:
    meter = DrainMeter(window_s=10.0)
    for t in times:
        meter.count(t)
    assert meter.rate(now) == (pytest.approx(expected) if expected is not None else None)


BURST_THEN_IDLE = [(0.0, False), (0.1, False), (0.2, False), (0.3, False), (0.4, True)]  # the last left none waiting


@pytest.mark.parametrize(
    ("dispatches", "now", "expected"),
    [
        pytest.param(
            [*BURST_THEN_IDLE, (8.4, False), (8.4, False), (8.4, False), (8.45, False)],
            8.5,
            4 / 0.1,
            id="a burst after an idle spell: its own rate",
        ),
        pytest.param([*BURST_THEN_IDLE, (8.4, False), (8.45, False)], 8.5, None, id="after an idle spell: too few yet"),
        pytest.param(BURST_THEN_IDLE, 8.4, None, id="idle, before the next dispatch: no rate (not the tail's)"),
        pytest.param(
            [*BURST_THEN_IDLE, (1.0, False), (1.1, False)], 1.2, 7 / 1.2, id="a short pause is not an idle spell"
        ),
        pytest.param(
            [(0.0, False), (2.5, False), (5.0, False), (7.5, False)],
            8.0,
            4 / 8.0,
            id="slow dispatches with a queue waiting: one rate",
        ),
    ],
)
def test_drain_rate_restarts_after_an_idle_spell(
    dispatches: list[tuple[float, bool]], now: float, expected: float | None
) -> None:
    meter = DrainMeter(window_s=10.0)
    for t, drained in dispatches:
        meter.count(t, drained=drained)
    assert meter.rate(now) == (pytest.approx(expected) if expected is not None else None)


async def test_a_full_queue_pushes_out_the_busiest_tenants_newest_ticket() -> None:
    queue = ClassQueue("interactive", CLASS)
    heavy = [ticket("heavy") for _ in range(3)]
    for t in heavy:
        queue.push(t)
    victim = queue.push_out("light")
    assert victim is heavy[-1]
    assert queue.depth == 2
    assert queue.ahead_of("light") == 1  # the heavy tenant gets one turn before light's second


async def test_no_push_out_when_the_arrival_is_the_busiest_tenant() -> None:
    queue = ClassQueue("interactive", CLASS)
    for name in ("a", "a", "b"):
        queue.push(ticket(name))
    assert queue.push_out("a") is None
    assert queue.push_out("b") is None  # a has only one more than b


async def test_a_light_tenant_waits_behind_only_what_fair_order_serves_first() -> None:
    """The work ahead of an arrival is counted by start tag: a flooding tenant's backlog is behind
    a light tenant's first ticket, and all of it is ahead of the flooding tenant's next one."""
    queue = ClassQueue("interactive", CLASS)
    for _ in range(10):
        queue.push(ticket("heavy"))
    drain(queue, 1)  # the virtual time is the tag of the ticket served last
    assert queue.ahead_of("light") == 0, "its start tag is the virtual time: before the heavy backlog"
    assert queue.ahead_of("heavy") == 9, "the heavy tenant's own backlog is all ahead of its next ticket"
    queue.push(ticket("light"))
    assert queue.ahead_of("light") == 2, "its first ticket, and the heavy ticket with the same tag"
    assert queue.ahead_of("heavy", limit=3) == 4, "counting stops past the limit"


async def test_a_heavier_weight_puts_more_of_a_tenants_backlog_ahead_of_another() -> None:
    queue = ClassQueue("interactive", CLASS)
    for _ in range(6):
        queue.push(ticket("gold", weight=3.0))
    assert queue.ahead_of("bronze") == 1, "the ticket at tag 0 (pushed first)"
    queue.push(ticket("bronze"))
    assert queue.ahead_of("bronze") == 1 + 4, "its own, and gold's tickets up to tag 100 (0, 33, 67, 100)"
    assert queue.by_tenant() == {"gold": (6, 600), "bronze": (1, 100)}
