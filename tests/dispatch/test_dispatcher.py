"""The dispatch rule: fast path, bounded class queues, strict class order, batch share, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from gateway.dialects.chat import CHAT
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.dispatcher import FAVOURITE_WAIT_S, Dispatcher, Grant
from gateway.dispatch.observers import DispatchObserver
from gateway.dispatch.quota import Quota
from gateway.dispatch.router import RoutingDecision
from gateway.errors import NoHealthyBackend, Overloaded
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.least_load import LeastLoadRouter
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from tests.fake_clock import FakeClock
from tests.policy_builder import NOWHERE, OMIT, build_policy, model, tenant
from tests.policy_builder import backend as backend_entry


def dispatch_policy(**sections: Any) -> str:
    """Model ``m`` on backend ``b1`` (two slots), tenant ``t``; interactive queues 3 for 5 s, batch
    queues 2 for 5 s and may hold half the slots; ``sections`` edit it (``tests/policy_builder.py``)."""
    dispatch = {
        "version": "t",
        "classes": {
            "interactive": {"queue": {"max_depth": 3, "max_wait_s": 5}},
            "batch": {
                "slo": {"ttft_ms": 5000, "itl_ms": 100, "e2e_ms": 60000},
                "max_share": 0.5,
                "queue": {"max_depth": 2, "max_wait_s": 5},
            },
        },
        "models": [model("m")],
        "backends": [backend_entry("b1", NOWHERE, ["m"], kind="sim", capacity={"max_concurrent": 2})],
        "tenants": [tenant("t", "k")],
    }
    return build_policy(NOWHERE, dispatch, **sections)


POLICY = dispatch_policy()


def request(tokens: int = 10) -> InferenceRequest:
    return InferenceRequest("id", CHAT, "m", {}, b"", False, False, tokens // 2, tokens - tokens // 2, 0.0)


@pytest.fixture
def snapshot() -> PolicySnapshot:
    return parse_policy(POLICY, "t.yaml")


def make_dispatcher(snapshot: PolicySnapshot, fleet_rebalances: bool = False) -> Dispatcher:
    router = LeastLoadRouter()
    return Dispatcher(
        BackendPool(snapshot), lambda model: router, FakeClock(), snapshot, fleet_rebalances=fleet_rebalances
    )


def paced_policy(max_prefilling: int) -> PolicySnapshot:
    """Batch paced to ``max_prefilling`` prefills per backend, with room for several requests."""
    text = dispatch_policy(
        classes={"batch": {"max_share": 1.0, "max_prefilling": max_prefilling}},
        backends={"b1": {"capacity": {"max_concurrent": 8}}},
    )
    return parse_policy(text, "t.yaml")


@pytest.fixture
def dispatcher(snapshot: PolicySnapshot) -> Dispatcher:
    return make_dispatcher(snapshot)


async def acquire(dispatcher: Dispatcher, snapshot: PolicySnapshot, class_name: str, tokens: int = 10) -> Grant:
    tenant = snapshot.policy.tenants[0]
    priority_class = snapshot.policy.classes[class_name]
    return await dispatcher.acquire(request(tokens), tenant, class_name, priority_class, deadline=1e9)


def state(dispatcher: Dispatcher) -> tuple[int, int, int]:
    backend = next(iter(dispatcher.pool.all()))
    depth = sum(q.depth for q in dispatcher.queues()["m"].classes)
    return backend.in_flight, backend.in_flight_tokens, depth


async def test_the_fast_path_places_at_once_and_release_returns_every_counter_to_zero(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    grant = await acquire(dispatcher, snapshot, "interactive")
    assert grant.queued_s == 0
    assert state(dispatcher) == (1, 10, 0)
    dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_a_full_backend_queues_and_a_release_hands_the_slot_over(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    waiter = asyncio.create_task(acquire(dispatcher, snapshot, "interactive"))
    await asyncio.sleep(0)
    assert state(dispatcher)[2] == 1
    assert not waiter.done()
    dispatcher.give_back("m", grants[0])
    third = await asyncio.wait_for(waiter, 1)
    assert state(dispatcher) == (2, 20, 0)
    for grant in (grants[1], third):
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_interactive_waiters_go_before_batch_waiters_that_came_first(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    batch = asyncio.create_task(acquire(dispatcher, snapshot, "batch"))
    await asyncio.sleep(0)
    interactive = asyncio.create_task(acquire(dispatcher, snapshot, "interactive"))
    await asyncio.sleep(0)
    dispatcher.give_back("m", grants[0])
    await asyncio.wait_for(interactive, 1)
    assert not batch.done()
    batch.cancel()
    await asyncio.gather(batch, return_exceptions=True)
    assert state(dispatcher)[2] == 0


async def test_batch_never_takes_more_than_its_share(dispatcher: Dispatcher, snapshot: PolicySnapshot) -> None:
    first = await acquire(dispatcher, snapshot, "batch")
    second = asyncio.create_task(acquire(dispatcher, snapshot, "batch"))
    await asyncio.sleep(0)
    assert not second.done(), "a second batch request would exceed max_share 0.5 of 2 slots"
    interactive = await acquire(dispatcher, snapshot, "interactive")
    assert interactive.state.in_flight == 2
    dispatcher.give_back("m", first)
    granted = await asyncio.wait_for(second, 1)
    for grant in (granted, interactive):
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_a_full_queue_refuses_at_once_with_retry_after(dispatcher: Dispatcher, snapshot: PolicySnapshot) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    waiters = [asyncio.create_task(acquire(dispatcher, snapshot, "interactive")) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as refused:
        await acquire(dispatcher, snapshot, "interactive")
    assert (refused.value.status, refused.value.code) == (503, "queue_full")
    assert int(refused.value.headers["retry-after"]) >= 1
    assert "limit 3" in refused.value.message
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    for grant in grants:
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_an_unmeetable_deadline_is_refused_before_queuing(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    meter = dispatcher.queues()["m"].meter
    for i in range(4):  # with the two grants below: 6 dispatches in 8 s, one waiter ahead means ~2.7 s
        meter.count(clock.now() - 8 + 2 * i)
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    waiter = asyncio.create_task(acquire(dispatcher, snapshot, "interactive"))
    await asyncio.sleep(0)
    tenant, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    with pytest.raises(Overloaded) as refused:
        await dispatcher.acquire(request(), tenant, "interactive", priority_class, deadline=clock.now() + 1.0)
    assert refused.value.code == "deadline_unmeetable"
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    for grant in grants:
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_the_drain_estimate_counts_what_other_processes_send_to_the_same_backends(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    """With a fleet, a slot freed by any process serves the highest class waiting anywhere: the
    same waiter as above, with the other processes sending 10 requests/s to ``b1`` (what the
    ledger reports), expects ~0.2 s and is queued, not refused."""
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    meter = dispatcher.queues()["m"].meter
    for i in range(4):
        meter.count(clock.now() - 8 + 2 * i)
    next(iter(dispatcher.pool.all())).others_rate = 10.0
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    waiter = asyncio.create_task(acquire(dispatcher, snapshot, "interactive"))
    await asyncio.sleep(0)
    tenant, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    queued = asyncio.create_task(
        dispatcher.acquire(request(), tenant, "interactive", priority_class, deadline=clock.now() + 1.0)
    )
    await asyncio.sleep(0)
    assert not queued.done(), "queued: the fleet drains the queue fast enough"
    assert state(dispatcher)[2] == 2
    for grant in grants:
        dispatcher.give_back("m", grant)
    served = [await waiter, await queued]
    for grant in served:
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


@pytest.mark.parametrize("rebalanced", [True, False], ids=["parts moved by a ledger", "fixed parts"])
async def test_room_held_unused_by_other_processes_is_waited_for_not_refused(
    snapshot: PolicySnapshot, rebalanced: bool
) -> None:
    """This process's part of ``b1`` is empty (a ledger just reset, or a replica just arrived) while
    the backend is idle fleet-wide: the ledger moves room here at the next sync, so the request
    waits for it instead of being refused on a slow drain estimate. With fixed parts (``--workers``
    without a store) nothing moves: the estimate stands."""
    dispatcher = make_dispatcher(snapshot, fleet_rebalances=rebalanced)
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    meter = dispatcher.queues()["m"].meter
    for i in range(4):  # 0.5 requests/s: one request's wait estimated at 2 s
        meter.count(clock.now() - 8 + 2 * i)
    b1 = next(iter(dispatcher.pool.all()))
    b1.quota = Quota(0, 0)
    tenant, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    waiting = asyncio.create_task(
        dispatcher.acquire(request(), tenant, "interactive", priority_class, deadline=clock.now() + 1.0)
    )
    await asyncio.sleep(0)
    if not rebalanced:
        with pytest.raises(Overloaded) as refused:
            await waiting
        assert refused.value.code == "deadline_unmeetable"
        return
    assert not waiting.done(), "queued for the room the next sync brings"
    b1.quota = Quota(2, 1_000_000)  # the sync's grant
    dispatcher.hand_out_all()
    dispatcher.give_back("m", await waiting)
    assert state(dispatcher) == (0, 0, 0)


async def test_a_wait_past_its_limit_ends_in_queue_timeout(dispatcher: Dispatcher, snapshot: PolicySnapshot) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    tenant, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    clock = dispatcher.clock
    with pytest.raises(Overloaded) as refused:
        await dispatcher.acquire(request(), tenant, "interactive", priority_class, deadline=clock.now() + 0.05)
    assert refused.value.code == "queue_timeout"
    assert state(dispatcher)[2] == 0
    for grant in grants:
        dispatcher.give_back("m", grant)


async def test_a_cancelled_waiter_leaves_the_queue_and_gets_nothing(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    waiter = asyncio.create_task(acquire(dispatcher, snapshot, "interactive"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert state(dispatcher)[2] == 0
    dispatcher.give_back("m", grants[0])
    assert state(dispatcher) == (1, 10, 0)
    dispatcher.give_back("m", grants[1])
    assert state(dispatcher) == (0, 0, 0)


async def test_no_healthy_backend_fails_at_once(dispatcher: Dispatcher, snapshot: PolicySnapshot) -> None:
    for backend in dispatcher.pool.all():
        backend.healthy = False
    with pytest.raises(NoHealthyBackend):
        await acquire(dispatcher, snapshot, "interactive")


async def test_draining_refuses_new_requests(dispatcher: Dispatcher, snapshot: PolicySnapshot) -> None:
    dispatcher.draining = True
    with pytest.raises(Overloaded) as refused:
        await acquire(dispatcher, snapshot, "interactive")
    assert (refused.value.status, refused.value.code) == (503, "draining")


async def test_draining_still_serves_the_later_attempts_of_requests_in_flight(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    """A retry or a stream migration belongs to a request already in flight: drain lets it finish."""
    dispatcher.draining = True
    tenant, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    grant = await dispatcher.acquire(
        request(10), tenant, "interactive", priority_class, deadline=1e9, exclude=frozenset({"x"})
    )
    dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


async def test_a_flooding_tenant_gives_way_to_another_in_a_full_queue(
    dispatcher: Dispatcher, snapshot: PolicySnapshot
) -> None:
    grants = [await acquire(dispatcher, snapshot, "interactive") for _ in range(2)]
    flood = [asyncio.create_task(acquire(dispatcher, snapshot, "interactive")) for _ in range(3)]
    await asyncio.sleep(0)
    other = snapshot.policy.tenants[0].model_copy(update={"name": "other"})
    priority_class = snapshot.policy.classes["interactive"]
    light = asyncio.create_task(dispatcher.acquire(request(), other, "interactive", priority_class, deadline=1e9))
    await asyncio.wait([flood[-1]], timeout=1)
    with pytest.raises(Overloaded) as pushed:
        flood[-1].result()
    assert pushed.value.code == "queue_full"
    dispatcher.give_back("m", grants[0])
    dispatcher.give_back("m", grants[1])
    await asyncio.wait_for(light, 1)
    assert not light.cancelled()
    for task in (*flood[:2], light):
        if task.done():
            dispatcher.give_back("m", task.result())
        else:
            task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    assert state(dispatcher)[2] == 0


async def test_a_paced_class_starts_its_next_request_only_after_a_first_token(snapshot: PolicySnapshot) -> None:
    paced = paced_policy(1)
    dispatcher = make_dispatcher(paced)
    first = await acquire(dispatcher, paced, "batch")
    second = asyncio.create_task(acquire(dispatcher, paced, "batch"))
    await asyncio.sleep(0)
    assert not second.done(), "a second batch prefill must wait for the first one's first token"
    interactive = await acquire(dispatcher, paced, "interactive")  # other classes are not paced
    dispatcher.first_token("m", interactive)
    dispatcher.first_token("m", first)
    granted = await asyncio.wait_for(second, 1)
    for grant in (first, granted, interactive):
        dispatcher.give_back("m", grant)
    backend = next(iter(dispatcher.pool.all()))
    assert (backend.in_flight, sum(backend.class_prefilling.values())) == (0, 0)


async def test_a_first_token_hands_the_prefill_out_after_the_chunk_not_inside_its_parse() -> None:
    """``first_token`` is called inside a stream's parse: it counts the prefill done at once, and
    the waiting request is routed and granted on the loop's next turn, never inside the caller."""
    paced = paced_policy(1)
    dispatcher = make_dispatcher(paced)
    batch_rank = paced.policy.classes["batch"].rank
    first = await acquire(dispatcher, paced, "batch")
    second = asyncio.create_task(acquire(dispatcher, paced, "batch"))
    await asyncio.sleep(0)
    backend = next(iter(dispatcher.pool.all()))
    dispatcher.first_token("m", first)
    dispatcher.first_token("m", first)  # a second call is a no-op
    assert backend.class_prefilling.get(batch_rank, 0) == 0, "the prefill is counted done at once"
    assert dispatcher.depth("m", batch_rank) == 1, "no other request is routed inside the parse"
    granted = await asyncio.wait_for(second, 1)
    for grant in (first, granted):
        dispatcher.give_back("m", grant)
    assert (backend.in_flight, sum(backend.class_prefilling.values())) == (0, 0)


async def test_a_paced_class_yields_to_a_higher_class_that_is_prefilling(snapshot: PolicySnapshot) -> None:
    paced = paced_policy(4)
    dispatcher = make_dispatcher(paced)
    interactive = await acquire(dispatcher, paced, "interactive")
    batch = asyncio.create_task(acquire(dispatcher, paced, "batch"))
    await asyncio.sleep(0)
    assert not batch.done(), "a batch prefill must not start while an interactive one runs"
    dispatcher.first_token("m", interactive)
    granted = await asyncio.wait_for(batch, 1)
    for grant in (interactive, granted):
        dispatcher.give_back("m", grant)


def test_the_default_wait_budget_leaves_room_for_the_measured_time_to_first_token(snapshot: PolicySnapshot) -> None:
    text = dispatch_policy(classes={"interactive": {"queue": {"max_depth": 3}}})
    policy = parse_policy(text, "t.yaml")
    dispatcher = make_dispatcher(policy)
    queues = dispatcher.queues()["m"]
    interactive, batch = policy.policy.classes["interactive"], policy.policy.classes["batch"]
    assert queues.wait_budget(interactive) == pytest.approx(0.5)  # the TTFT objective
    for _ in range(200):
        queues.observe_service_ttft(0.3)
    assert queues.wait_budget(interactive) == pytest.approx(0.2, abs=1e-3)
    for sample in (0.1, 0.2) * 50:  # mean 0.15, mean deviation 0.05: the tail is 0.35
        queues.observe_service_ttft(sample)
    assert queues.wait_budget(interactive) == pytest.approx(0.15, abs=0.03)
    assert queues.wait_budget(batch) == 5  # an explicit max_wait_s stands


LANES = dispatch_policy(
    classes={"batch": {"max_share": OMIT, "queue": {"max_depth": 3, "max_wait_s": 5}}},
    backends=[
        backend_entry("a", "http://127.0.0.1:1", ["m"], kind="sim", tenants=["acme"], capacity={"max_concurrent": 1}),
        backend_entry("g", "http://127.0.0.1:2", ["m"], kind="sim", tenants=["globex"], capacity={"max_concurrent": 1}),
        backend_entry("s", "http://127.0.0.1:3", ["m"], kind="sim", capacity={"max_concurrent": 1}),
    ],
    tenants=[tenant("acme", "a"), tenant("globex", "g")],
)
"""acme may use a and s, globex g and s: two lanes of one model, sharing backend s."""


async def acquire_as(dispatcher: Dispatcher, snapshot: PolicySnapshot, tenant: str, class_name: str) -> Grant:
    who = next(t for t in snapshot.policy.tenants if t.name == tenant)
    priority_class = snapshot.policy.classes[class_name]
    return await dispatcher.acquire(request(), who, class_name, priority_class, deadline=1e9)


async def test_lanes_wait_apart_and_a_shared_backend_goes_to_the_higher_class_of_any_lane() -> None:
    snapshot = parse_policy(LANES, "t.yaml")
    dispatcher = make_dispatcher(snapshot)
    held = [await acquire_as(dispatcher, snapshot, "acme", "interactive") for _ in range(2)]
    assert sorted(g.state.name for g in held) == ["a", "s"]
    on_g = await acquire_as(dispatcher, snapshot, "globex", "interactive")
    assert on_g.state.name == "g"
    acme_batch = asyncio.create_task(acquire_as(dispatcher, snapshot, "acme", "batch"))
    await asyncio.sleep(0)
    globex_interactive = asyncio.create_task(acquire_as(dispatcher, snapshot, "globex", "interactive"))
    await asyncio.sleep(0)
    assert (dispatcher.depth("m", 0), dispatcher.depth("m", 1)) == (1, 1)
    assert sum(q.depth for q in dispatcher.queues()["m"].classes) == 0, "neither waits in the model's own lane"
    dispatcher.give_back("m", next(g for g in held if g.state.name == "s"))
    granted = await asyncio.wait_for(globex_interactive, 1)
    assert granted.state.name == "s"
    assert not acme_batch.done()
    dispatcher.give_back("m", next(g for g in held if g.state.name == "a"))
    batch = await asyncio.wait_for(acme_batch, 1)
    assert batch.state.name == "a"
    for grant in (on_g, granted, batch):
        dispatcher.give_back("m", grant)
    assert sum(s.in_flight for s in dispatcher.pool.all()) == 0
    assert dispatcher.depth("m", 0) == dispatcher.depth("m", 1) == 0


async def test_a_slot_freed_on_a_backend_of_two_models_goes_to_the_other_model_s_waiter() -> None:
    """Two models on one backend (a model group's targets with the same engine): a slot one model
    gives back is handed to a request of the other model waiting for it, at once."""
    shared = parse_policy(
        dispatch_policy(
            models=[model("m"), model("n")],
            backends=[backend_entry("b1", NOWHERE, ["m", "n"], kind="sim", capacity={"max_concurrent": 1})],
        ),
        "t.yaml",
    )
    dispatcher = make_dispatcher(shared)
    tenant_t, interactive = shared.policy.tenants[0], shared.policy.classes["interactive"]
    holder = await dispatcher.acquire(request(), tenant_t, "interactive", interactive, 1e9)
    other = InferenceRequest("id2", CHAT, "n", {}, b"", False, False, 5, 5, 0.0)
    waiter = asyncio.create_task(dispatcher.acquire(other, tenant_t, "interactive", interactive, 1e9))
    await asyncio.sleep(0)
    assert not waiter.done()
    dispatcher.give_back("m", holder)
    granted = await asyncio.wait_for(waiter, 1)
    assert granted.state.name == "b1"
    dispatcher.give_back("n", granted)


TWO_TENANTS = dispatch_policy(
    classes={"interactive": {"queue": {"max_depth": 20, "max_wait_s": 5}}},
    tenants=[tenant("heavy", "k1"), tenant("light", "k2")],
)


async def flooded(clock: FakeClock, dispatcher: Dispatcher, snapshot: PolicySnapshot) -> list[asyncio.Task[Grant]]:
    """``heavy`` holds both slots of ``b1`` and has four more waiting, one of which went first
    (the virtual time moved to its tag); 7 dispatches in 8 s: the drain rate is 0.875/s."""
    heavy, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    meter = dispatcher.queues()["m"].meter
    for i in range(4):
        meter.count(clock.now() - 8 + 2 * i)
    grants = [await dispatcher.acquire(request(), heavy, "interactive", priority_class, 1e9) for _ in range(2)]
    waiters = [
        asyncio.create_task(dispatcher.acquire(request(), heavy, "interactive", priority_class, 1e9)) for _ in range(4)
    ]
    await asyncio.sleep(0)
    dispatcher.give_back("m", grants[0])
    return waiters


@pytest.mark.parametrize(
    ("arriving", "refused"),
    [
        pytest.param("light", False, id="a light tenant's request waits one dispatch and is queued"),
        pytest.param("heavy", True, id="the flooding tenant's next request waits behind its backlog and is refused"),
    ],
)
async def test_the_wait_estimate_follows_the_fair_queues_order(arriving: str, refused: bool) -> None:
    """The issue's light tenant at 2 requests/s was refused ``deadline_unmeetable`` 22 to 24 times
    of 73 while a neighbour flooded: the estimate counted a ticket per waiting tenant, though fair
    order serves the light tenant's first. Here the light tenant's estimate is 1/0.875 s (nothing
    ahead of it; 1.43 s with the margin, within its 2 s); counting the flooding tenant's
    head as ahead of it gave 2.3 s (2.9 s with the margin): refused."""
    snapshot = parse_policy(TWO_TENANTS, "t.yaml")
    dispatcher = make_dispatcher(snapshot)
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    waiters = await flooded(clock, dispatcher, snapshot)
    tenant_ = next(t for t in snapshot.policy.tenants if t.name == arriving)
    priority_class = snapshot.policy.classes["interactive"]
    arrival = asyncio.create_task(
        dispatcher.acquire(request(), tenant_, "interactive", priority_class, deadline=clock.now() + 2.0)
    )
    await asyncio.sleep(0)
    if refused:
        with pytest.raises(Overloaded) as error:
            await arrival
        assert error.value.code == "deadline_unmeetable"
    else:
        assert not arrival.done(), "queued"
    for task in [*waiters, *([] if refused else [arrival])]:
        task.cancel()
    await asyncio.gather(*waiters, arrival, return_exceptions=True)


@pytest.mark.parametrize(
    ("elsewhere", "arriving", "refused"),
    [
        pytest.param(
            {"heavy": (1.0, 30)}, "light", False, id="a flood waiting in another process is behind a light tenant"
        ),
        pytest.param({"light": (1.0, 3)}, "light", True, id="its own tenant's requests waiting elsewhere are ahead"),
        pytest.param(
            {"other": (1.0, 1)} | {f"t{i}": (1.0, 1) for i in range(3)},
            "light",
            True,
            id="one request of each other tenant waiting elsewhere is ahead",
        ),
    ],
)
async def test_the_wait_estimate_counts_the_fleets_queue_in_fair_order(
    elsewhere: dict[str, tuple[float, int]], arriving: str, refused: bool
) -> None:
    """A slot freed anywhere in the fleet serves the fleet's queue: the estimate counts what the
    other processes have waiting (the ledger names it by tenant) in fair order, over the fleet's
    dispatch rate (here 10 dispatches in 8 s). With nothing ahead but one request of the flood,
    the estimate is 1.6 s (2 s with the margin, within 3 s); three of its own tenant's ahead, 3.2 s."""
    snapshot = parse_policy(TWO_TENANTS, "t.yaml")
    dispatcher = make_dispatcher(snapshot)
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    meter = dispatcher.queues()["m"].meter
    for i in range(8):
        meter.count(clock.now() - 8 + i)
    light, priority_class = snapshot.policy.tenants[1], snapshot.policy.classes["interactive"]
    grants = [await dispatcher.acquire(request(), light, "interactive", priority_class, 1e9) for _ in range(2)]
    dispatcher.heard("b1", {0: elsewhere})
    arrival = asyncio.create_task(
        dispatcher.acquire(request(), light, "interactive", priority_class, deadline=clock.now() + 3.0)
    )
    await asyncio.sleep(0)
    assert arrival.done() == refused
    if refused:
        with pytest.raises(Overloaded) as error:
            await arrival
        assert error.value.code == "deadline_unmeetable"
    else:
        arrival.cancel()
        await asyncio.gather(arrival, return_exceptions=True)
    for grant in grants:
        dispatcher.give_back("m", grant)
    assert state(dispatcher) == (0, 0, 0)


@pytest.mark.parametrize(
    ("gap_s", "since_s"),
    [
        pytest.param(0.1, 9.5, id="after an idle spell: the last burst's tail over 9.8 s, 0.4/s"),
        pytest.param(1.9, 1.0, id="after a trickle: one request every 1.9 s, 0.6/s"),
    ],
)
async def test_a_burst_is_judged_by_the_engines_drain_not_by_what_this_process_sent(
    gap_s: float, since_s: float
) -> None:
    """fleet_stress "C=4 after 8 s": a process whose part of the engine was 0 when a burst came
    judged it before its first dispatch by what it had sent lately (the last burst's tail spread
    over the idle spell; or a trickle: the demand, not the drain), the others idle (0/s), and
    refused its third request ``deadline_unmeetable`` (3 / 0.4 = 7.5 s, 3 / 0.6 = 5 s, more than
    its 2 s) where the engine finishes 2 requests every 0.1 s: 6 ahead take 0.3 s."""
    snapshot = parse_policy(TWO_TENANTS, "t.yaml")
    dispatcher = make_dispatcher(snapshot)
    dispatcher.fleet_rebalances = True
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    heavy, priority_class = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    grant = await dispatcher.acquire(request(), heavy, "interactive", priority_class, 1e9)
    clock.advance(0.1)
    dispatcher.give_back("m", grant)  # the engine held a request 0.1 s: its 2 slots drain 20/s
    meter = dispatcher.queues()["m"].meter
    for i in range(4):
        meter.count(clock.now() + gap_s * i, drained=True)
    clock.advance(gap_s * 3 + since_s)
    b1 = next(iter(dispatcher.pool.all()))
    b1.quota = Quota(0, 0)  # its part when the burst comes
    arrivals = [
        asyncio.create_task(dispatcher.acquire(request(), heavy, "interactive", priority_class, clock.now() + 2.0))
        for _ in range(6)
    ]
    await asyncio.sleep(0)
    assert not any(arrival.done() for arrival in arrivals), "all queued"
    b1.quota = Quota(2, 1_000_000)  # the next sync's part
    for arrival in arrivals:
        dispatcher.hand_out_all()
        dispatcher.give_back("m", await arrival)
    assert state(dispatcher) == (0, 0, 0)


async def test_higher_classes_waiting_in_other_processes_are_ahead(snapshot: PolicySnapshot) -> None:
    dispatcher = make_dispatcher(snapshot)
    clock = dispatcher.clock
    assert isinstance(clock, FakeClock)
    meter = dispatcher.queues()["m"].meter
    for i in range(8):
        meter.count(clock.now() - 8 + i)
    tenant_, batch = snapshot.policy.tenants[0], snapshot.policy.classes["batch"]
    grant = await dispatcher.acquire(request(), tenant_, "batch", batch, 1e9)  # batch's share: one of two slots
    b1 = next(iter(dispatcher.pool.all()))
    b1.others_waiting = {0: 4}
    with pytest.raises(Overloaded) as error:
        await dispatcher.acquire(request(), tenant_, "batch", batch, deadline=clock.now() + 4.0)
    assert error.value.code == "deadline_unmeetable", "four interactive requests elsewhere, at 1/s"
    b1.others_waiting = {}
    dispatcher.give_back("m", grant)


class PrefersB1(LeastLoadRouter):
    """Picks ``b1`` whenever it is a candidate (a conversation's slot is there), else the least loaded."""

    def pick(self, request: InferenceRequest, tenant: Any, candidates: Sequence[BackendState]) -> RoutingDecision:
        chosen = next((s for s in candidates if s.name == "b1"), None)
        return RoutingDecision(chosen, "test", "prefix_match") if chosen else super().pick(request, tenant, candidates)


class CountsDemand(DispatchObserver):
    """Stands for the fleet coordinator: notes each time the dispatcher says demand moved."""

    def __init__(self, woken: list[int]) -> None:
        self.woken = woken

    def demand_changed(self) -> None:
        self.woken.append(1)


def favourite_setup(rebalanced: bool = True) -> tuple[Dispatcher, PolicySnapshot, list[int]]:
    """``b1`` (the router's favourite) idle fleet-wide but none of it this process's part; ``b2`` all here."""
    snapshot = parse_policy(
        dispatch_policy(
            backends=[
                backend_entry("b1", NOWHERE, ["m"], kind="sim", capacity={"max_concurrent": 2}),
                backend_entry("b2", NOWHERE, ["m"], kind="sim", capacity={"max_concurrent": 2}),
            ]
        ),
        "t.yaml",
    )
    router = PrefersB1()
    woken: list[int] = []
    dispatcher = Dispatcher(
        BackendPool(snapshot),
        lambda model: router,
        FakeClock(),
        snapshot,
        observer=CountsDemand(woken),
        fleet_rebalances=rebalanced,
    )
    b1 = next(s for s in dispatcher.pool.all() if s.name == "b1")
    b1.quota = Quota(0, 0)
    return dispatcher, snapshot, woken


def backend_named(dispatcher: Dispatcher, name: str) -> BackendState:
    return next(s for s in dispatcher.pool.all() if s.name == name)


async def test_a_request_waits_for_its_favourites_part_and_goes_there() -> None:
    """The favourite has room fleet-wide, only not in this process's part: the request queues (the
    coordinator is woken, and the demand is reported for the favourite), and takes the favourite
    once the sync moves a part here, rather than ``b2`` which has room at once."""
    dispatcher, snapshot, woken = favourite_setup()
    snapshot_tenant = snapshot.policy.tenants[0]
    priority_class = snapshot.policy.classes["interactive"]
    waiting = asyncio.create_task(
        dispatcher.acquire(request(), snapshot_tenant, "interactive", priority_class, deadline=1e9)
    )
    await asyncio.sleep(0)
    assert not waiting.done(), "held for its favourite's part"
    assert woken, "the coordinator syncs at once"
    assert dispatcher.waiting()["b1"][0][0] == 1, "the wait is reported for the favourite"
    assert "b1" in dispatcher.tenants()
    backend_named(dispatcher, "b1").quota = Quota(2, 1_000_000)  # the sync's grant
    dispatcher.hand_out_all()
    grant = await asyncio.wait_for(waiting, 5)
    assert grant.state.name == "b1"
    dispatcher.give_back("m", grant)
    assert backend_named(dispatcher, "b1").in_flight == 0


@pytest.mark.parametrize("deadline_s", [1e9, 0.2], ids=["class budget", "short deadline"])
async def test_a_held_request_takes_what_has_room_once_its_hold_is_over(deadline_s: float) -> None:
    """No part comes: after ``FAVOURITE_WAIT_S`` (at most half of what it may wait) the request
    takes ``b2``; it is neither refused nor kept past its deadline."""
    dispatcher, snapshot, _ = favourite_setup()
    policy = snapshot.policy
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = dispatcher.clock.now() + deadline_s
    grant = await asyncio.wait_for(
        dispatcher.acquire(request(), policy.tenants[0], "interactive", policy.classes["interactive"], deadline), 5
    )
    waited = loop.time() - started
    assert grant.state.name == "b2"
    bound = min(FAVOURITE_WAIT_S, deadline_s / 2)
    assert bound * 0.9 <= waited < min(deadline_s, bound + 0.5)
    dispatcher.give_back("m", grant)


@pytest.mark.parametrize("retry", [True, False], ids=["a retry", "fixed parts"])
async def test_a_retry_or_a_fleet_without_moving_parts_is_never_held(retry: bool) -> None:
    dispatcher, snapshot, woken = favourite_setup(rebalanced=retry)
    policy = snapshot.policy
    exclude = frozenset({"b3"}) if retry else frozenset()
    acquiring = asyncio.ensure_future(
        dispatcher.acquire(
            request(), policy.tenants[0], "interactive", policy.classes["interactive"], 1e9, exclude=exclude
        )
    )
    await asyncio.sleep(0)
    assert acquiring.done(), "placed at once"
    grant = acquiring.result()
    assert (grant.state.name, grant.queued_s) == ("b2", 0.0)
    assert not woken
    dispatcher.give_back("m", grant)


async def test_a_queued_retry_takes_the_first_room_not_its_favourite() -> None:
    """A retry that had to queue (no room here) is handed the first backend to free up, even while
    its favourite has room only fleet-wide: it left a backend on purpose and is never held."""
    dispatcher, snapshot, _ = favourite_setup()
    policy = snapshot.policy
    tenant, interactive = policy.tenants[0], policy.classes["interactive"]
    exclude = frozenset({"b3"})
    grants = [await dispatcher.acquire(request(), tenant, "interactive", interactive, 1e9, exclude) for _ in range(2)]
    assert [g.state.name for g in grants] == ["b2", "b2"]
    retry = asyncio.create_task(dispatcher.acquire(request(), tenant, "interactive", interactive, 1e9, exclude))
    await asyncio.sleep(0)
    assert not retry.done(), "no room here: queued"
    dispatcher.give_back("m", grants[0])
    await asyncio.sleep(0)
    assert retry.done(), "handed b2 as soon as it frees"
    assert retry.result().state.name == "b2"
    for grant in (grants[1], retry.result()):
        dispatcher.give_back("m", grant)
