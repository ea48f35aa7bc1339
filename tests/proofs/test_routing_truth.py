"""The engine-truth bench's set-up (``loadtests/proofs/routing_truth.py``): the tokenizer the engines
and the gateway share, the traffic's plans, each mode's policy, the configurations, the watch on the
gateway's KV-event index, and ``routing_bench --truth`` as its alias. No bench runs here."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.service import parse_policy
from loadtests.proofs import routing_bench
from loadtests.proofs.routing_system import ADMIN_KEY
from loadtests.proofs.routing_truth import (
    CONFIGS,
    PRESSURE,
    TRUTH_MODES,
    IndexWatch,
    TruthLoad,
    not_runnable,
    parse,
    results_dir,
    truth_plans,
    truth_policy,
)
from loadtests.proofs.routing_truth_engines import CHAT_TEMPLATE, Engines, write_tokenizer
from loadtests.sim.profiles import BLOCK_SIZE
from tests.servers import serve_in_thread, wait_until

MODES = {m.name: m for m in TRUTH_MODES}


def test_plans_are_the_same_for_every_mode_of_a_repetition_and_differ_between_repetitions() -> None:
    load = TruthLoad()
    assert truth_plans(load, 1, 7) == truth_plans(load, 1, 7)
    assert truth_plans(load, 1, 7) != truth_plans(load, 2, 7)


@pytest.mark.parametrize("config", sorted(CONFIGS), ids=lambda c: f"config {c}")
def test_plans_send_every_turn_once_in_order_and_the_direct_share_around_its_target(config: str) -> None:
    load = CONFIGS[config]
    steps = [step for plan in truth_plans(load, 1, 1) for step in plan]
    turns = [s for s in steps if s.engine < 0]
    assert Counter((s.tenant, s.conv) for s in turns) == {
        (t, c): load.turns for t in range(1, load.tenants + 1) for c in range(1, load.conversations + 1)
    }
    for plan in truth_plans(load, 1, 1):
        seen: dict[tuple[int, int], int] = {}
        for s in plan:
            if s.engine < 0:
                assert s.turn == seen.get((s.tenant, s.conv), 0) + 1
                seen[(s.tenant, s.conv)] = s.turn
    direct = [s for s in steps if s.engine >= 0]
    assert {s.engine for s in direct} <= set(range(load.engines))
    assert len(direct) / len(steps) == pytest.approx(load.direct_share, abs=0.05)


def test_pressure_evicts_more_than_the_default_and_the_default_is_the_first_results() -> None:
    assert CONFIGS["default"] == TruthLoad()
    default, pressure = CONFIGS["default"], CONFIGS["pressure"]
    assert pressure is PRESSURE
    assert pressure != default
    # the bytes sent per unit of cache: more tenants' prompts, more direct traffic, or a smaller cache
    assert (pressure.tenants * pressure.system_words + pressure.direct_share * pressure.direct_words) / (
        pressure.kv_cache_tokens
    ) > (default.tenants * default.system_words + default.direct_share * default.direct_words) / (
        default.kv_cache_tokens
    )


@pytest.mark.parametrize(
    ("argv", "out"),
    [
        ([], "loadtests/results/routing-truth"),
        (["--config", "pressure"], "loadtests/results/routing-truth-pressure"),
        (["--config", "pressure", "--out", "/tmp/x"], "/tmp/x"),
    ],
    ids=["the default goes to the first results", "pressure to its own", "--out wins"],
)
def test_each_configuration_writes_its_own_results(argv: list[str], out: str) -> None:
    args, _ = parse(argv)
    assert args.out == Path(out)


def test_a_field_given_on_its_own_overrides_the_configurations() -> None:
    _, load = parse(["--config", "pressure", "--tenants", "5", "--direct-share", "0.1"])
    assert (load.tenants, load.direct_share) == (5, 0.1)
    assert load.system_words == PRESSURE.system_words
    assert results_dir("pressure") == Path("loadtests/results/routing-truth-pressure")


def test_engines_on_the_simulators_tokenizer_publish_nothing_and_the_events_mode_does_not_run() -> None:
    engines = Engines.of(3, None)
    assert "--kv-events" not in engines.options(0, 0.26, 4.0)
    assert not_runnable(MODES["events"], "sim")
    assert not_runnable(MODES["estimate"], "sim") is None
    assert not_runnable(MODES["events"], "bench") is None


def _policy(mode: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    engines = Engines.of(3, write_tokenizer(tmp_path / "tokenizer.json"))
    text = truth_policy(4.0, MODES[mode], [8001, 8002, 8003], TruthLoad(), engines)
    return text, yaml.safe_load(text)


def test_the_events_mode_points_the_gateway_at_each_engines_sockets_hashing_and_the_tokenizer(tmp_path: Path) -> None:
    _, policy = _policy("events", tmp_path)
    backends = policy["backends"]
    assert [b["kv_events"]["hashing"] for b in backends] == [
        {"algorithm": "sha256_cbor", "seed": "0", "block_size": BLOCK_SIZE}
    ] * 3
    assert len({b["kv_events"]["endpoint"] for b in backends}) == 3
    assert all(b["kv_events"]["replay_endpoint"].startswith("tcp://127.0.0.1:") for b in backends)
    model = policy["models"][0]
    assert model["tokenizer"] == {"path": str(tmp_path / "tokenizer.json"), "chat_template": str(CHAT_TEMPLATE)}
    assert model["routing"]["strategy"] == "prefix_affinity"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "events"], ids=lambda m: f"{m} keeps estimating")
def test_the_other_modes_have_neither_events_nor_tokenizer_and_load(mode: str, tmp_path: Path) -> None:
    text, policy = _policy(mode, tmp_path)
    assert all("kv_events" not in b for b in policy["backends"])
    assert "tokenizer" not in policy["models"][0]
    # the oracle's gateway registers its strategy before it loads the policy; the rest is the same
    parse_policy(text.replace("strategy: oracle", "strategy: prefix_affinity"), f"routing-truth {mode}")


def test_the_events_policy_loads(tmp_path: Path) -> None:
    text, _ = _policy("events", tmp_path)
    parse_policy(text, "routing-truth events")


class FakeAdmin:
    """``/admin/backends`` whose engine-0 index holds ``blocks`` in turn, one reading per call."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.calls = 0
        self.refused = 0
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def backends(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {ADMIN_KEY}":
                self.refused += 1
                return JSONResponse({"error": {"message": "no", "type": "forbidden", "code": "forbidden"}}, 403)
            with self.lock:
                blocks = self.blocks[min(self.calls, len(self.blocks) - 1)]
                self.calls += 1
            feed = {"endpoint": "tcp://x:1", "replay_endpoint": None, "live": True, "blocks": blocks}
            return JSONResponse(
                {"backends": [{"name": "engine-1", "kv_events": None}, {"name": "engine-0", "kv_events": feed}]}
            )

        return Starlette(routes=[Route("/admin/backends", backends)])


@pytest.mark.parametrize(
    ("blocks", "calls", "seen"),
    [
        ([120, 120, 120, 0, 5], 4, [120, 0]),
        ([120, 120, 40, 41], 3, [120, 40]),
    ],
    ids=["emptied (the fresh engine's AllBlocksCleared)", "cleared and refilled between two readings (a replay)"],
)
def test_the_index_watch_records_when_the_gateway_dropped_the_restarted_engines_index(
    blocks: list[int], calls: int, seen: list[int]
) -> None:
    admin = FakeAdmin(blocks)
    with serve_in_thread(admin.app()) as url:
        watch = IndexWatch(url, "engine-0", interval_s=0.001).start()
        wait_until(lambda: watch.cleared_at is not None, timeout=10.0, what="the index dropped")
        assert watch.stop() == watch.cleared_at == watch.readings[-1][0]
    assert watch.blocks_at_start == 120
    assert [b for _, b in watch.readings] == seen
    assert admin.calls == calls  # it stops polling once it has seen the drop
    assert admin.refused == 0


@pytest.mark.parametrize("blocks", [[50], [50, 60, 70, 80]], ids=["unchanged", "grown without a clear"])
def test_the_index_watch_reports_none_when_the_index_was_never_dropped(blocks: list[int]) -> None:
    admin = FakeAdmin(blocks)
    with serve_in_thread(admin.app()) as url:
        watch = IndexWatch(url, "engine-0", interval_s=0.001).start()
        wait_until(lambda: admin.calls >= 5, timeout=10.0, what="a few readings")
        assert watch.stop() is None
    assert watch.blocks_at_start == 50


def test_routing_bench_truth_is_routing_truth_under_its_first_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        routing_bench.main(["--truth", "--config", "pressure", "--help"])
    assert exit_.value.code == 0
    assert "--engine-tokenizer" in capsys.readouterr().out
