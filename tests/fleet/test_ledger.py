"""The capacity ledger's rule, against the real Redis: processes share each backend by demand.

Each test plays several processes (``FleetLedger``s with their own ids) under a key prefix of
its own. The rule is in ``gateway/fleet/ledger.py``: what every process may be using never sums
past the capacity (its part as granted or as it still applies it), a process never holds less
than it uses, higher classes' demand is served first, each rank's capacity is shared max-min fairly across
the tenants the processes report (by weight), and a process that stops syncing keeps
what it may still use until its drain ends, unless it is known dead or leaves.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping, Sequence

import pytest
import redis.asyncio as aioredis

from gateway.dispatch.quota import Quota, Share, TenantUse
from gateway.fleet.ledger import BackendReport, FleetLedger, LedgerGrant
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix

REQUESTS, TOKENS, PREFILLS = 10, 1000, 2
SHARE = Share(5, 500)
BATCH = 1


@pytest.fixture
async def processes() -> AsyncIterator[list[FleetLedger]]:
    prefix = unique_prefix()
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield [FleetLedger(client, key_prefix=prefix, replica=f"p{i}", lease_ttl_s=30.0) for i in range(3)]
    finally:
        await client.aclose()
        drop_keys(REDIS_URL, prefix)


def report(
    requests: int = 0,
    waiting: Mapping[int, tuple[int, int]] | None = None,
    prefilling: Mapping[int, int] | None = None,
    batch_requests: int = 0,
    rate: float = 0.0,
    applied: Quota | None = None,
    tenants: Sequence[TenantUse] = (),
) -> list[BackendReport]:
    """One backend ``b`` with 10 requests, 1,000 tokens, 2 batch prefills and a batch share of half.

    Every request in flight counts 10 tokens."""
    return [
        BackendReport(
            name="b",
            max_requests=REQUESTS,
            max_tokens=TOKENS,
            max_prefills={BATCH: PREFILLS},
            max_shares={BATCH: SHARE},
            requests=requests,
            tokens=requests * 10,
            prefilling=prefilling or {},
            class_use={BATCH: Share(batch_requests, batch_requests * 10)},
            waiting=waiting or {},
            rate=rate,
            applied=applied,
            tenants=tenants,
        )
    ]


async def grant(process: FleetLedger, **reported: object) -> LedgerGrant:
    return (await process.sync(report(**reported))).grants["b"]  # type: ignore[arg-type]


async def test_a_process_alone_holds_the_whole_capacity(processes: list[FleetLedger]) -> None:
    alone = await grant(processes[0])
    assert (alone.requests, alone.tokens, alone.prefills) == (REQUESTS, TOKENS, {BATCH: PREFILLS})
    assert alone.shares == {BATCH: SHARE}


async def test_an_idle_fleet_splits_the_capacity_evenly_as_headroom(processes: list[FleetLedger]) -> None:
    for process in processes:
        await grant(process)
    grants = [await grant(process) for process in processes]
    assert sorted(g.requests for g in grants) == [3, 3, 4]
    assert sum(g.tokens for g in grants) == TOKENS


async def test_a_higher_class_waiting_elsewhere_is_served_before_a_lower_one(processes: list[FleetLedger]) -> None:
    batchy, interactive = processes[0], processes[1]
    await grant(batchy, waiting={BATCH: (10, 100)})
    await grant(interactive, waiting={0: (3, 30)})
    # Of 10 slots: 3 for the interactive requests, 5 for batch (its share: the rest of its demand
    # could not run), the 2 left as headroom, one each.
    assert (await grant(batchy, waiting={BATCH: (10, 100)})).requests == 6, "the batch process gives 4 back"
    granted = await grant(interactive, waiting={0: (3, 30)})
    assert granted.requests == 4, "the interactive process takes what the batch one gave back"
    seen = await grant(batchy, waiting={BATCH: (10, 100)})
    assert seen.others_waiting == {0: 3}, "each process sees what the others wait for, by class"


async def test_each_process_learns_how_fast_the_others_send_to_the_backend(processes: list[FleetLedger]) -> None:
    """What a process's drain estimate adds to its own rate (``Dispatcher._drain_rate``)."""
    first, second, third = processes
    await first.sync(report(rate=5.0))
    await second.sync(report(rate=2.5))
    assert (await third.sync(report(rate=1.0))).grants["b"].others_rate == 7.5
    assert (await first.sync(report(rate=5.0))).grants["b"].others_rate == 3.5, "its own rate is not counted"


async def test_each_process_learns_what_the_others_have_in_flight_on_the_backend(
    processes: list[FleetLedger],
) -> None:
    """What routing adds to this process's own load (``BackendState.fleet_in_flight``)."""
    first, second, third = processes
    await first.sync(report(requests=3))
    await second.sync(report(requests=2))
    seen = (await third.sync(report(requests=1))).grants["b"]
    assert (seen.others_requests, seen.others_tokens) == (5, 50)
    seen = (await first.sync(report(requests=3))).grants["b"]
    assert (seen.others_requests, seen.others_tokens) == (3, 30), "its own requests are not counted"


async def test_a_process_never_holds_less_than_it_uses(processes: list[FleetLedger]) -> None:
    busy, other = processes[0], processes[1]
    await grant(busy, requests=9)
    await grant(other, waiting={0: (10, 100)})
    assert (await grant(busy, requests=9)).requests == 9, "requests in flight are never taken back"
    assert (await grant(other, waiting={0: (10, 100)})).requests == 1, "the other grows only into what is free"


async def test_the_holdings_never_sum_past_the_capacity_whatever_the_order(processes: list[FleetLedger]) -> None:
    rng = random.Random(7)
    held: dict[int, LedgerGrant] = {}
    for _ in range(400):
        index = rng.randrange(len(processes))
        before = held.get(index)
        uses = rng.randrange(0, (before.requests if before else 0) + 1)
        prefilling = rng.randrange(0, (before.prefills.get(BATCH, 0) if before else 0) + 1)
        batch = rng.randrange(0, min(uses, before.shares[BATCH].requests if before else 0) + 1)
        waiting = {rank: (rng.randrange(0, 6), rng.randrange(0, 300)) for rank in (0, BATCH)}
        held[index] = await grant(
            processes[index], requests=uses, waiting=waiting, prefilling={BATCH: prefilling}, batch_requests=batch
        )
        assert held[index].requests >= uses
        assert held[index].shares[BATCH] >= (batch, batch * 10)
        assert sum(g.requests for g in held.values()) <= REQUESTS
        assert sum(g.tokens for g in held.values()) <= TOKENS
        assert sum(g.prefills.get(BATCH, 0) for g in held.values()) <= PREFILLS
        assert sum(g.shares[BATCH].requests for g in held.values()) <= SHARE.requests
        assert sum(g.shares[BATCH].tokens for g in held.values()) <= SHARE.tokens


async def test_a_class_share_holds_across_processes_each_holding_what_it_uses(processes: list[FleetLedger]) -> None:
    """Why the share is a budget of its own: per-process parts of ``max_share`` would not sum to it.

    Two processes each running 4 batch requests on a 10-request backend with a 0.5 batch share
    would, each reading its own part as ``0.5 x its requests``, both stay under their bound while
    the backend runs 8 batch requests: 3 above the share the policy states.
    """
    first, second = processes[0], processes[1]
    await grant(first, requests=4, batch_requests=4, waiting={BATCH: (4, 40)})
    held = await grant(first, requests=4, batch_requests=4, waiting={BATCH: (4, 40)})
    assert held.shares[BATCH] == SHARE, "alone, the first process may hold the whole share"
    other = await grant(second, waiting={BATCH: (6, 60)})
    held = await grant(first, requests=4, batch_requests=4, waiting={BATCH: (4, 40)})
    other = await grant(second, waiting={BATCH: (6, 60)})
    assert held.shares[BATCH] >= (4, 40), "batch requests in flight are never taken back"
    assert held.shares[BATCH].requests + other.shares[BATCH].requests <= SHARE.requests, "together within the share"
    assert held.shares[BATCH].tokens + other.shares[BATCH].tokens <= SHARE.tokens, "and within its tokens"
    assert other.shares[BATCH].requests == SHARE.requests - held.shares[BATCH].requests, "it grows into what is free"


async def test_waiting_demand_past_a_class_share_is_no_demand(processes: list[FleetLedger]) -> None:
    """Batch queued past its share could not run: it must not take the headroom an interactive
    arrival on another process needs, without a round trip to the ledger."""
    batchy, interactive = processes[0], processes[1]
    flood = {BATCH: (100, 1000)}
    await grant(batchy, requests=5, batch_requests=5, waiting=flood)
    await grant(interactive)
    held = await grant(batchy, requests=5, batch_requests=5, waiting=flood)
    free = await grant(interactive)
    assert held.requests + free.requests == REQUESTS
    assert free.requests >= (REQUESTS - 5) // 2, "the idle process keeps half the free slots as headroom"


LEASE_S, DRAIN_S = 2.0, 30.0


@pytest.fixture
async def clocked() -> AsyncIterator[tuple[list[FleetLedger], FakeClock]]:
    """Three processes whose ledger reads a ``FakeClock`` (leases and drains without sleeping)."""
    prefix, clock = unique_prefix(), FakeClock()
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield (
            [
                FleetLedger(
                    client, key_prefix=prefix, replica=f"p{i}", lease_ttl_s=LEASE_S, drain_s=DRAIN_S, clock=clock
                )
                for i in range(3)
            ],
            clock,
        )
    finally:
        await client.aclose()
        drop_keys(REDIS_URL, prefix)


async def test_a_silent_process_keeps_what_it_may_use_until_its_drain_ends(
    clocked: tuple[list[FleetLedger], FakeClock],
) -> None:
    """Past its lease a silent process may be alive and cut off, its requests running on: the
    ledger keeps its whole part (a tombstone, no headroom) until the drain ends, then frees it."""
    (silent, survivor, _), clock = clocked
    await grant(silent, requests=8)
    clock.advance(LEASE_S + 0.1)
    seen = await survivor.sync(report(waiting={0: (10, 100)}))
    assert seen.tombstones == ("p0",)
    assert seen.live == 1
    assert seen.grants["b"].requests == 0, "all ten may still be used by the silent process"
    clock.advance(DRAIN_S - 0.2)
    assert (await grant(survivor, waiting={0: (10, 100)})).requests == 0
    clock.advance(0.2)
    assert (await grant(survivor, waiting={0: (10, 100)})).requests == REQUESTS, "the drain is over"


async def test_a_tombstone_known_dead_is_freed_at_once(clocked: tuple[list[FleetLedger], FakeClock]) -> None:
    (dead, survivor, _), clock = clocked
    await grant(dead, requests=8)
    clock.advance(LEASE_S + 0.1)
    assert (await survivor.sync(report(), reap=["p0"])).tombstones == ()
    assert (await grant(survivor, waiting={0: (10, 100)})).requests == REQUESTS


async def test_a_live_process_is_never_reaped(clocked: tuple[list[FleetLedger], FakeClock]) -> None:
    (alive, other, _), _ = clocked
    await grant(alive, requests=8)
    seen = await other.sync(report(), reap=["p0"])  # a mistaken neighbour: p0 synced within its lease
    assert seen.live == 2
    assert seen.grants["b"].others_requests == 8, "p0 is still counted"
    assert (await grant(alive, requests=8)).requests >= 8


async def test_a_process_that_leaves_frees_its_part_at_once(clocked: tuple[list[FleetLedger], FakeClock]) -> None:
    (leaving, staying, _), _ = clocked
    await grant(leaving, requests=0, waiting={0: (10, 100)})
    await leaving.leave()
    assert (await grant(staying, waiting={0: (10, 100)})).requests == REQUESTS


async def test_a_part_still_applied_is_never_given_to_another_until_its_owner_syncs_again(
    processes: list[FleetLedger],
) -> None:
    """The race that put 5 requests on a capacity of 4: a process reports 2 in use while it
    enforces a part of 10, and goes on starting requests under that part until the answer (a
    smaller part) reaches it. Another process syncing meanwhile must not be given any of the 10."""
    owner, other, _ = processes
    await other.sync(report())
    await owner.sync(report(requests=2, waiting={0: (8, 80)}))
    await other.sync(report())  # gives up its headroom to the owner's demand
    assert (await grant(owner, requests=2, waiting={0: (8, 80)})).requests == REQUESTS
    shrunk = (await owner.sync(report(requests=2, applied=Quota(REQUESTS, TOKENS)))).grants["b"]
    assert shrunk.requests < REQUESTS, "idle now: the owner's part shrinks to leave the other headroom"
    taken = (await other.sync(report(waiting={0: (10, 100)}))).grants["b"]
    assert taken.requests == 0, "the owner may still start requests on the 10 it enforces"
    await owner.sync(report(requests=2, applied=Quota(shrunk.requests, shrunk.tokens)))  # applied, and said so
    assert (await other.sync(report(waiting={0: (10, 100)}))).grants["b"].requests > 0


async def test_a_ledger_that_lost_its_keys_has_a_new_epoch(processes: list[FleetLedger]) -> None:
    first = await processes[0].sync(report())
    assert first.epoch == (await processes[1].sync(report())).epoch
    drop_keys(REDIS_URL, processes[0].key_prefix)
    assert (await processes[0].sync(report())).epoch != first.epoch


def flood(tenant: str, requests: int, waiting: int, weight: float = 1.0) -> TenantUse:
    """A tenant at the interactive rank: ``requests`` in flight, ``waiting`` queued (10 tokens each)."""
    return TenantUse(tenant, 0, weight, requests, requests * 10, waiting, waiting * 10, 10)


async def test_a_light_tenant_on_another_process_gets_its_fair_part_of_a_flooded_backend(
    processes: list[FleetLedger],
) -> None:
    """The issue's flood: one tenant holds every slot on one process and queues more; a tenant
    served lately on another process is idle now. The flooding process is told to hold one slot
    less than it uses (it starts nothing until one of its requests ends); the ledger counts what
    it uses until it says so; then the slot is the light tenant's process's, for its next arrival."""
    heavy, light = processes[0], processes[1]
    await grant(heavy, requests=REQUESTS, waiting={0: (12, 120)}, tenants=[flood("heavy", REQUESTS, 12)])
    idle = [TenantUse("light", 0, 1.0, next_tokens=10)]
    assert (await grant(light, tenants=idle)).requests == 0, "all ten are in use"
    full = Quota(REQUESTS, TOKENS)
    told = await grant(heavy, requests=REQUESTS, waiting={0: (12, 120)}, applied=full, tenants=[flood("heavy", 10, 12)])
    assert told.requests == REQUESTS - 1, "the flooding tenant's share: all but the light tenant's one"
    assert (await grant(light, tenants=idle)).requests == 0, "the flooding process still uses ten"
    applied = Quota(told.requests, told.tokens)
    again = await grant(heavy, requests=9, waiting={0: (13, 130)}, applied=applied, tenants=[flood("heavy", 9, 13)])
    assert again.requests == REQUESTS - 1
    seen = await grant(light, tenants=idle)
    assert seen.requests == 1, "the slot the flood gave back is the light tenant's headroom"
    assert seen.others_tenants == {0: {"heavy": (1.0, 13)}}, "who waits elsewhere, by tenant"


async def test_flooding_tenants_on_two_processes_share_a_backend_by_weight(processes: list[FleetLedger]) -> None:
    gold, bronze = processes[0], processes[1]
    await grant(gold, waiting={0: (20, 200)}, tenants=[flood("gold", 0, 20, weight=2.0)])
    await grant(bronze, waiting={0: (20, 200)}, tenants=[flood("bronze", 0, 20)])
    assert (await grant(gold, waiting={0: (20, 200)}, tenants=[flood("gold", 0, 20, weight=2.0)])).requests == 7
    assert (await grant(bronze, waiting={0: (20, 200)}, tenants=[flood("bronze", 0, 20)])).requests == 3


async def test_a_tenant_on_two_processes_has_one_share_split_between_them(processes: list[FleetLedger]) -> None:
    """Fairness is per tenant, fleet-wide: a tenant that floods through two replicas gets no more than one
    that floods through one."""
    first, second, third = processes
    for _ in range(2):
        parts = [
            await grant(first, waiting={0: (20, 200)}, tenants=[flood("spread", 0, 20)]),
            await grant(second, waiting={0: (20, 200)}, tenants=[flood("spread", 0, 20)]),
            await grant(third, waiting={0: (20, 200)}, tenants=[flood("single", 0, 20)]),
        ]
    assert [p.requests for p in parts] == [3, 2, 5] or [p.requests for p in parts] == [2, 3, 5]


async def test_a_tenants_headroom_never_idles_while_the_same_tenant_waits_in_another_process(
    processes: list[FleetLedger],
) -> None:
    """Headroom (a tenant's recent peak, one request more) is kept for a tenant's next arrivals
    against other tenants; within one tenant, what it waits for anywhere goes first."""
    first, second = processes[0], processes[1]
    busy = [TenantUse("a", 0, 1.0, waiting=8, waiting_tokens=80, next_tokens=10)]
    calm = [TenantUse("a", 0, 1.0, waiting=2, waiting_tokens=20, next_tokens=10, peak=5)]
    for _ in range(2):
        parts = [
            await grant(first, waiting={0: (8, 80)}, tenants=busy),
            await grant(second, waiting={0: (2, 20)}, tenants=calm),
        ]
    assert [p.requests for p in parts] == [8, 2]


async def test_a_higher_classs_headroom_never_idles_while_a_lower_class_waits_with_room_in_its_share(
    processes: list[FleetLedger],
) -> None:
    """fleet_stress "C=4 after 8 s": two processes idle, their interactive tenant served lately
    (headroom: its recent peak and one more), held every slot for its next arrivals while batch
    waited on the third with its whole share free, until the 10 s of "lately" ran out (bursts of
    2.5 s took 11). Headroom comes from what the lower ranks' use and waiting leave; their
    waiting past the class's share is still no demand (above)."""
    first, second, third = processes
    served_lately = [
        TenantUse("interactive", 0, 1.0, next_tokens=10, peak=6),
        TenantUse("batch", BATCH, 1.0, next_tokens=10, peak=1),
    ]
    batch_waiting = [TenantUse("batch", BATCH, 1.0, waiting=8, waiting_tokens=80, next_tokens=10)]
    for _ in range(2):
        parts = [
            await grant(first, tenants=served_lately),
            await grant(second, tenants=served_lately),
            await grant(third, waiting={BATCH: (8, 80)}, tenants=batch_waiting),
        ]
    assert parts[2].requests == SHARE.requests, "batch waits: its share, within the capacity, is its"
    assert parts[2].shares[BATCH].requests == SHARE.requests
    assert parts[0].requests + parts[1].requests == REQUESTS - SHARE.requests, "the rest is interactive's headroom"
