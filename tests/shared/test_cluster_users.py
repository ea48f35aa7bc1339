"""Every user of the shared store on a real three-node Redis Cluster, and fleet cells apart.

``state.redis_url: redis+cluster://...`` reaches every user: the tenant limits, the capacity
ledger, the prefix view, response affinity's shared map and the rollouts' store. Real parts:
three simulated gateway processes of ``loadtests/proofs/fleet_scale.py`` (each the real limit store and
``TenantLimiter``, fleet coordinator and ledger, prefix view, response affinity and rollout store,
with its own clients) against a cluster of three ``redis-server`` nodes on loopback. The
processes are in two fleet cells (``fleet.cell``): each cell has a ledger and a prefix view of
its own, on a slot of its own, while the tenant limits stay one fleet-wide budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster as SyncCluster
from redis.crc import key_slot

from gateway.fleet.ledger import ledger_base
from gateway.fleet.prefix_wire import origin_of
from gateway.policy.loader import PolicyError
from gateway.service import parse_policy
from loadtests.proofs.fleet_scale import Shared, SimConfig, SimProcess, fleet_cell_of, sim_policy
from tests.fake_backend import FakeBackend
from tests.fleet.test_cluster_slots import every_path
from tests.fleet.test_shared_capacity import CAPACITY, fleet_policy, gateways, held, sdk_stream
from tests.policy_builder import redis_state
from tests.servers import metric, serve_in_thread, wait_until
from tests.shared.redis_cluster import cluster_url

PROCESSES = every_path("redis://unused").processes
CELLS = every_path("redis://unused").fleet_cells


def config(url: str) -> SimConfig:
    return every_path(url)


@pytest.fixture
def ran(cluster: list[int]) -> Iterator[tuple[Shared, list[dict[str, object]], SyncCluster]]:
    """Three simulated processes in two cells, run until every path was taken, then stopped."""
    url = cluster_url(cluster[:2])
    shared = Shared()
    seen: list[dict[str, object]] = []

    async def run() -> None:
        sims = [SimProcess(i, config(url), shared) for i in range(PROCESSES)]
        await asyncio.gather(*(sim.start() for sim in sims))
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if shared.counts["followups_elsewhere"] >= 3 and shared.counts["requests"] >= 30:
                    break
                await asyncio.sleep(0.05)
            for sim in sims:
                await sim.coordinator.sync_once()
                seen.append({"cell": sim.ledger.base, "live": sim.coordinator.live, "up": sim.coordinator.up})
        finally:
            await asyncio.gather(*(sim.stop() for sim in sims))

    asyncio.run(run())
    client = SyncCluster(host="127.0.0.1", port=cluster[0])
    try:
        yield shared, seen, client
    finally:
        client.close()


def test_every_user_of_the_shared_store_works_on_a_cluster(
    ran: tuple[Shared, list[dict[str, object]], SyncCluster],
) -> None:
    shared, seen, _ = ran
    counts = shared.counts
    assert counts["requests"] >= 30, dict(counts)
    assert counts["followups_elsewhere"] >= 3, dict(counts)
    failed = {name: n for name, n in counts.items() if name.startswith(("store_error", "store_fallback"))}
    assert not failed, f"the limit store failed on the cluster: {failed}"
    assert counts["followup_unavailable"] == 0, dict(counts)
    assert counts["followup_not_found"] == 0, dict(counts)
    assert counts["rollout_unavailable"] == 0, dict(counts)
    assert all(process["up"] for process in seen), seen


def test_each_fleet_cell_has_its_own_ledger_on_its_own_slot(
    ran: tuple[Shared, list[dict[str, object]], SyncCluster],
) -> None:
    _, seen, client = ran
    members = {cell: [i for i in range(PROCESSES) if fleet_cell_of(i, CELLS) == cell] for cell in ("c0", "c1")}
    assert [process["live"] for process in seen] == [len(members[fleet_cell_of(i, CELLS)]) for i in range(PROCESSES)]
    bases = {cell: ledger_base("gw:", cell) for cell in members}
    assert key_slot(f"{bases['c0']}:replicas".encode()) != key_slot(f"{bases['c1']}:replicas".encode())
    for base in bases.values():  # every key of a cell's ledger in the slot of its hash tag
        keys = [f"{base}:replicas", f"{base}:backends", f"{base}:epoch"]
        keys += [f"{base}:b:{name.decode()}" for name in client.smembers(f"{base}:backends")]  # type: ignore[union-attr]
        assert len({key_slot(key.encode()) for key in keys}) == 1, keys
        assert client.exists(f"{base}:epoch") == 1


def test_each_fleet_cell_has_its_own_prefix_view(
    ran: tuple[Shared, list[dict[str, object]], SyncCluster],
) -> None:
    from gateway.fleet.prefix_sync import prefix_view_key

    _, _, client = ran
    writers: dict[str, set[str]] = {}
    for cell in ("c0", "c1"):
        base = parse_policy(sim_policy(config("redis://127.0.0.1:1/0"), cell), "cell.yaml").policy
        key = prefix_view_key(base, "sim")
        entries = client.xrange(key)
        assert entries, f"cell {cell} published decisions"
        writers[cell] = {origin_of(fields) for _, fields in entries}  # type: ignore[arg-type]
    assert len(writers["c0"]) == 2, writers
    assert len(writers["c1"]) == 1, writers
    assert not writers["c0"] & writers["c1"], "a process writes only to its own cell's view"


def test_a_policy_accepts_a_cluster_url_and_a_cell() -> None:
    text = sim_policy(config("redis+cluster://10.0.0.1:7000,10.0.0.2:7001"), "eu-1")
    policy = parse_policy(text, "cluster.yaml").policy
    assert policy.state.redis_url == "redis+cluster://10.0.0.1:7000,10.0.0.2:7001"
    assert policy.fleet.cell == "eu-1"
    assert ledger_base(policy.state.key_prefix, policy.fleet.cell) == "gw:{fleet:eu-1}"
    assert ledger_base("gw:", "") == "gw:{fleet}", "the unnamed cell keeps the keys of the ledger before cells"


def test_a_cell_name_that_would_break_its_hash_tag_is_refused() -> None:
    with pytest.raises(PolicyError, match="cell"):
        parse_policy(sim_policy(config("redis://127.0.0.1:1/0"), "eu}1"), "bad.yaml")


def test_two_gateways_on_a_cluster_keep_a_backend_within_its_capacity(cluster: list[int]) -> None:
    """The whole gateway (``serve``'s wiring: one shared-store client for the ledger, the prefix
    view, affinity and rollouts; the limit store's own) with ``state.redis_url`` a cluster URL."""
    backend = FakeBackend()
    answers: list[str] = []
    with serve_in_thread(backend) as backend_url:
        text = fleet_policy(backend_url, redis_state(cluster_url(cluster[:2]), "gw:"), cell="eu-1")
        with gateways(text, 2) as urls, held(backend, lambda url: sdk_stream(url, answers), urls, 6):
            queued = lambda: sum(metric(url, "gateway_queue_depth") for url in urls)  # noqa: E731
            wait_until(lambda: backend.active == CAPACITY and queued() == 6 - CAPACITY, what="two served, four queued")
            assert [metric(url, "gateway_fleet_processes") for url in urls] == [2, 2]
    assert len(answers) == 6, "everyone answered, in turn"
    assert all(answers), answers
    assert backend.most_active == CAPACITY, "the backend never held more than its capacity"
    client = SyncCluster(host="127.0.0.1", port=cluster[0])
    try:
        assert client.exists(f"{ledger_base('gw:', 'eu-1')}:epoch") == 1, "the ledger is the cell's"
    finally:
        client.close()
