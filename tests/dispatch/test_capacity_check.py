"""Declared capacity against the engine's own limits: the rules, and a gateway process saying so."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dispatch.capacity_check import Disagreement, compare
from gateway.dispatch.engine_limits import EngineLimits
from gateway.policy.model import Backend
from loadtests.sim import build_engine_app
from loadtests.sim.profiles import BLOCK_SIZE
from tests.conftest import CHAT_MODEL
from tests.policy_builder import admin_keys, backend, build_policy, model
from tests.servers import metric, serve_in_process, serve_in_thread, wait_until


def declared(max_concurrent: int = 8, kv_cache_tokens: int | None = None) -> Backend:
    capacity: dict[str, Any] = {"max_concurrent": max_concurrent, "kv_cache_tokens": kv_cache_tokens}
    return Backend(name="b", url="http://e", kind="llamacpp", models=["m"], capacity=capacity)  # type: ignore[arg-type]


def fields(found: list[Disagreement]) -> list[tuple[str, int, int]]:
    return [(d.field, d.declared, d.engine) for d in found]


def test_more_requests_than_the_engine_runs_disagree() -> None:
    found = compare(declared(max_concurrent=8), EngineLimits(4, None, "GET /props"))
    assert fields(found) == [("max_concurrent", 8, 4)]
    assert "queue" in found[0].why
    assert "backend b: capacity.max_concurrent is 8 in the policy but the engine reports 4" in found[0].message()


def test_under_half_of_what_the_engine_runs_disagrees_and_half_or_more_does_not() -> None:
    idle = compare(declared(max_concurrent=3), EngineLimits(8, None, "GET /props"))
    assert fields(idle) == [("max_concurrent", 3, 8)]
    assert "idle" in idle[0].why
    assert compare(declared(max_concurrent=4), EngineLimits(8, None, "GET /props")) == []
    assert compare(declared(max_concurrent=8), EngineLimits(8, None, "GET /props")) == []


def test_kv_tokens_more_than_ten_percent_off_either_way_disagree() -> None:
    engine = EngineLimits(None, 10_000, "vllm:cache_config_info on /metrics")
    assert compare(declared(kv_cache_tokens=11_000), engine) == []
    assert compare(declared(kv_cache_tokens=9_000), engine) == []
    assert fields(compare(declared(kv_cache_tokens=11_001), engine)) == [("kv_cache_tokens", 11_001, 10_000)]
    assert fields(compare(declared(kv_cache_tokens=8_999), engine)) == [("kv_cache_tokens", 8_999, 10_000)]


def test_nothing_is_compared_where_a_side_gives_no_figure() -> None:
    assert compare(declared(max_concurrent=1000), EngineLimits(None, None, "unknown")) == []
    assert compare(declared(kv_cache_tokens=None), EngineLimits(None, 10_000, "vllm")) == []


def sim_policy(url: str, kv_cache_tokens: int) -> str:
    sim = backend("sim-a", url, [CHAT_MODEL], kind="sim", capacity={"kv_cache_tokens": kv_cache_tokens})
    return build_policy(
        url,
        backends=[sim],
        models=[model(CHAT_MODEL, max_prompt_tokens=64, max_output_tokens=32)],
        health_checks={"interval_s": 0.2, "timeout_s": 1},
        admin=admin_keys(ADMIN_KEY),
    )


ADMIN_KEY = "admin-key-capacity-check"


def shown(admin_url: str) -> dict[str, Any]:
    """The capacity part of backend sim-a in ``GET /admin/backends``."""
    answer = httpx.get(admin_url + "/admin/backends", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    assert answer.status_code == 200, answer.text
    (entry,) = [b for b in answer.json()["backends"] if b["name"] == "sim-a"]
    capacity: dict[str, Any] = entry["capacity"]
    return capacity


@pytest.mark.skipif(sys.platform == "win32", reason="SIGHUP reload")
def test_a_gateway_process_warns_of_a_disagreeing_engine_and_clears_it_after_a_fixing_reload() -> None:
    app = build_engine_app("fixed", model=CHAT_MODEL)
    assert app.engine is not None
    engine_kv = app.profile.num_kv_blocks * BLOCK_SIZE
    wrong = engine_kv // 4
    with serve_in_thread(app) as sim_url, tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(sim_policy(sim_url, wrong))
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        with serve_in_process([*argv, "--log-level", "info"]) as gateway:
            said = f"backend sim-a: capacity.kv_cache_tokens is {wrong} in the policy but the engine reports"
            said += f" {engine_kv}"

            def warned() -> bool:
                return any("WARNING" in line and said in line for line in gateway.lines)

            wait_until(warned, 20, what="the WARNING naming the backend and both figures")
            kv = {"backend": "sim-a", "field": "kv_cache_tokens"}
            assert metric(gateway.admin_url, "gateway_backend_engine_limit", **kv) == engine_kv
            assert metric(gateway.admin_url, "gateway_backend_capacity_disagreement", **kv) == 1
            capacity = shown(gateway.admin_url)
            assert capacity["engine"] == {"max_concurrent": None, "kv_cache_tokens": engine_kv}
            assert capacity["declared"]["kv_cache_tokens"] == wrong
            assert [(d["field"], d["declared"], d["engine"]) for d in capacity["disagreements"]] == [
                ("kv_cache_tokens", wrong, engine_kv)
            ]

            path.write_text(sim_policy(sim_url, engine_kv))  # the operator fixes the policy and reloads
            os.kill(gateway.proc.pid, signal.SIGHUP)
            wait_until(
                lambda: metric(gateway.admin_url, "gateway_backend_capacity_disagreement", **kv) == 0,
                20,
                what="the disagreement to clear after the reload",
            )
            assert metric(gateway.admin_url, "gateway_backend_engine_limit", **kv) == engine_kv
            assert sum(said in line for line in gateway.lines) == 1  # said once, not at every health round
            assert shown(gateway.admin_url)["disagreements"] == []
