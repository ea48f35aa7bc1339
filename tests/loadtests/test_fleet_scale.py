"""``loadtests/proofs/fleet_scale.py`` counts what it claims to count, and its whole run produces a sizing.

Real parts: a private ``redis-server`` whose own command statistics the client-side counts are
checked against, and the bench itself (its worker processes, its private Redis servers) on a
tiny fleet.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from loadtests.proofs import fleet_scale
from loadtests.proofs.fleet_scale import Tally, fit_line, instrument, under
from tests.limitstore.redis_server import RedisProcess


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    process = RedisProcess()
    process.start()
    yield process
    process.stop()


async def test_each_round_trip_and_command_counts_under_its_source_as_redis_saw_them(server: RedisProcess) -> None:
    tally = Tally()
    restore = instrument(tally)
    try:
        client = aioredis.Redis.from_url(server.url)
        await under("one", client.set("k", "1"))
        async with client.pipeline(transaction=False) as pipe:
            pipe.set("a", "1")
            pipe.set("b", "2")
            pipe.get("a")
            await under("pipelined", pipe.execute())
        script = client.register_script("return redis.call('GET', KEYS[1])")
        await under("script", script(keys=["k"]))  # EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA: three round trips
        await client.aclose()
    finally:
        restore()
    assert tally.round_trips == {"one": 1, "pipelined": 1, "script": 3}
    assert tally.commands == {"one": 1, "pipelined": 3, "script": 3}
    assert tally.handshakes["one"] >= 1, "the connection's handshake is counted apart"
    with server.client() as sync:
        stats = sync.info("commandstats")
    assert stats["cmdstat_set"]["calls"] == 3
    assert stats["cmdstat_evalsha"]["calls"] == 2
    assert set(tally.signatures) >= {"SET", "GET", "SCRIPT", "EVALSHA " + fleet_scale._text(script.sha)[:12]}


def test_a_line_fits_exactly_and_one_point_has_no_slope() -> None:
    assert fit_line([(1, 3), (2, 5), (4, 9)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(10, 7)]) == (7.0, 0.0)


def test_the_bench_measures_a_small_fleet_and_sizes_the_large_ones(tmp_path: Path) -> None:
    fleet_scale.main(
        [
            "--processes", "2,3", "--rate", "4", "--rate-high", "8", "--warmup-s", "1", "--window-s", "2",
            "--calibrate-concurrency", "4", "--lease-cell", "2:20:1", "--split-cell", "4:2", "--cell-size", "10",
            "--label", "tiny", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    document = json.loads((tmp_path / "tiny.json").read_text())
    cells = document["cells"]
    assert [(c["processes"], c["rate_per_process"], c["role"], c["fleet_cells"]) for c in cells] == [
        (2, 4.0, "fleet", 1),
        (2, 8.0, "fleet", 1),
        (3, 4.0, "fleet", 1),
        (4, 4.0, "fleet", 2),
        (2, 20.0, "lease", 1),
    ]
    admit = document["model"]["round_trips"]["admit"]
    assert admit["from_lease_cell"]["tenants"] == 1  # admission's per-request cost from the lease cell
    lease_admits = cells[-1]["sources"].get("admit", {}).get("round_trips_per_request", 0.0)  # none: leases held
    assert admit["per_request"] <= lease_admits
    for cell in cells:
        assert cell["requests_per_s"] > 0
        assert cell["sources"]["ledger"]["round_trips_per_process_per_s"] > 2, "the coordinator synced"
        assert cell["sources"]["prefix"]["round_trips_per_process_per_s"] > 2, "the prefix view exchanged"
        assert all(family["connected_clients"] > 0 for family in cell["families"].values())
    fleets = document["fleets"]
    assert [(f["replicas"], f["fleet_cells"]) for f in fleets] == [(10, 1), (100, 1), (1000, 1), (100, 10), (1000, 100)]
    assert all(f["redis_cpu_cores"] > 0 and f["memory_bytes"] > 0 for f in fleets)
    whole, split = fleets[2], fleets[4]  # 1,000 replicas: one ledger, or 100 cells of 10
    assert split["hottest_slot_cores"] < whole["hottest_slot_cores"] / 10, "a cell's slot carries a cell's cost"
    assert split["cores_by_family"]["limits"] == whole["cores_by_family"]["limits"], "limits stay fleet-wide"
    text = (tmp_path / "tiny.txt").read_text()
    assert "extrapolated to 2000 req/s per replica" in text
    assert "4 processes in 2 cells of 2: ledger" in text
