"""Declared capacity against the engine's own limits: the rules, and a gateway process saying so."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client import CollectorRegistry, Gauge

from gateway.dispatch.backends import BackendPool
from gateway.dispatch.capacity import Held, held
from gateway.dispatch.capacity_check import RETRY_FIRST_S, CapacityCheck, CapacityGauges, Disagreement, compare
from gateway.dispatch.engine_limits import EngineLimits
from gateway.policy.model import Backend
from gateway.service import parse_policy
from loadtests.harness.shared_redis import REDIS_URL
from loadtests.sim import build_engine_app
from loadtests.sim.profiles import BLOCK_SIZE
from tests.conftest import CHAT_MODEL, KEY_ACME, StartGateway
from tests.dispatch.fake_llamacpp import LLAMA, FakeLlamacpp, llamacpp_policy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import drop_keys, unique_prefix
from tests.policy_builder import admin_keys, backend, build_policy, model, redis_state
from tests.servers import admin_url, free_port, metric, serve_in_process, serve_in_thread, wait_until


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


# --- capacity: auto --------------------------------------------------------------------------------


def test_a_figure_taken_from_the_engine_never_disagrees() -> None:
    auto = Backend(name="b", url="http://e", kind="llamacpp", models=["m"], capacity="auto")  # type: ignore[arg-type]
    assert compare(auto, EngineLimits(64, 1_000_000, "GET /props")) == []
    kv_only = Backend.model_validate(
        {**auto.model_dump(), "capacity": {"max_concurrent": 99, "kv_cache_tokens": "auto"}}
    )
    assert fields(compare(kv_only, EngineLimits(8, 1_000_000, "GET /props"))) == [("max_concurrent", 99, 8)]


def auto_kv_policy(url: str) -> str:
    """The simulator publishes its KV cache (vLLM's cache_config_info), not its --max-num-seqs."""
    capacity = {"max_concurrent": 4, "kv_cache_tokens": "auto"}
    sim = backend("sim-a", url, [CHAT_MODEL], kind="sim", capacity=capacity)
    return build_policy(url, backends=[sim], models=[model(CHAT_MODEL, max_prompt_tokens=64, max_output_tokens=32)])


def gauges() -> CapacityGauges:
    registry = CollectorRegistry()
    return CapacityGauges(
        Gauge("d", "d", ["backend", "field"], registry=registry),
        Gauge("l", "l", ["backend", "field"], registry=registry),
    )


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING)


async def test_auto_takes_the_kv_cache_of_a_simulated_engine_and_holds_the_backend_until_it_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    snapshot = parse_policy(auto_kv_policy(f"http://127.0.0.1:{port}"), "policy.yaml")
    pool = BackendPool(snapshot)
    (state,) = pool.all()
    clock, changes, reads = FakeClock(), [], []

    async def count(request: httpx.Request) -> None:
        reads.append(request.url.path)

    async with httpx.AsyncClient(event_hooks={"request": [count]}) as client:
        check = CapacityCheck(client, gauges(), clock=clock, on_change=lambda: changes.append(state.name))
        check.apply(pool.all())
        assert check.status()["sim-a"]["ready"] is False
        assert held(state, clock.now(), 1.0) is Held.ENGINE_LIMITS_UNREAD

        caplog.set_level(logging.INFO, logger="gateway.dispatch.capacity_check")
        await check.check(pool.all())  # nothing listens on the port yet
        assert state.backend.capacity.awaiting_engine == ("kv_cache_tokens",)
        not_read = (
            "backend sim-a is not ready: capacity.kv_cache_tokens is auto but the engine's limits could not be read"
        )
        assert said(caplog, not_read) == 1
        not_ready = check.status()["sim-a"]["not_ready"]
        assert not_ready["awaiting"] == ["kv_cache_tokens"]
        assert "unreadable" in not_ready["why"]

        app = build_engine_app("fixed", model=CHAT_MODEL)
        engine_kv = app.profile.num_kv_blocks * BLOCK_SIZE
        with serve_in_thread(app, port=port):
            await check.check(pool.all())
            assert reads == ["/metrics"], "within its backoff the engine is not read again"
            clock.advance(RETRY_FIRST_S)
            await check.check(pool.all())
            assert reads == ["/metrics", "/metrics"]
            assert state.backend.capacity.kv_cache_tokens == engine_kv
            assert state.backend.capacity.max_concurrent == 4, "the declared figure stays"
            assert held(state, clock.now(), 1.0) is None
            assert changes == ["sim-a"], "told once: the fleet's parts are resized, waiting requests handed out"
            assert said(caplog, "backend sim-a is now ready: its capacity from the engine: kv_cache_tokens") == 1
            shown_now = check.status()["sim-a"]
            assert shown_now["declared"] == {"max_concurrent": 4, "kv_cache_tokens": "auto"}
            assert shown_now["engine"] == {"max_concurrent": None, "kv_cache_tokens": engine_kv}
            assert (shown_now["ready"], shown_now["disagreements"]) == (True, [])

            await check.check(pool.all())
            assert len(reads) == 2, "read once: a health round does not read a ready engine again"
            reloaded = parse_policy(
                auto_kv_policy(state.backend.url).replace("version: test-1", "version: test-2"), "p"
            )
            pool.adopt(reloaded)  # a reload: the pool takes the policy's backend, its kv_cache_tokens unread
            assert state.backend.capacity.awaiting_engine == ("kv_cache_tokens",)
            check.apply(pool.all(), reloaded=True)  # in the same step: the figure it had, no unready instant
            assert state.backend.capacity.kv_cache_tokens == engine_kv
            await check.check(pool.all())
            assert len(reads) == 3, "every reload reads the engine again"
    assert said(caplog, "is not ready") == 1, "said once, not at every health round"


def ask(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
        reply = sdk.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=4)
    return reply.choices[0].message.content or ""


def capacity_of(api_url: str, name: str) -> dict[str, Any]:
    """The capacity part of backend ``name`` in ``GET /admin/backends`` of the gateway serving ``api_url``."""
    answer = httpx.get(admin_url(api_url) + "/admin/backends", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.text
    (entry,) = [b for b in answer.json()["backends"] if b["name"] == name]
    capacity: dict[str, Any] = entry["capacity"]
    return capacity


def test_a_gateway_sends_an_auto_backend_nothing_until_it_reads_the_engine_then_uses_its_slots(
    start_gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeLlamacpp(slots=3, props_status=503)  # /props fails: its limits cannot be read yet
    caplog.set_level(logging.WARNING, logger="gateway.dispatch.capacity_check")
    unread = {"backend": LLAMA, "reason": "engine_limits_unread"}
    with (
        serve_in_thread(engine) as engine_url,
        start_gateway(llamacpp_policy(engine_url, admin=admin_keys(ADMIN_KEY))) as url,
    ):
        wait_until(lambda: "503" in str(capacity_of(url, LLAMA).get("not_ready")), what="the failed read shown")
        shown_unready = capacity_of(url, LLAMA)
        assert shown_unready["ready"] is False
        assert shown_unready["not_ready"]["awaiting"] == ["max_concurrent", "kv_cache_tokens"]
        assert metric(url, "gateway_backend_held", **unread) == 1
        assert metric(url, "gateway_fleet_quota_requests", backend=LLAMA) == 0, "no room while unread"
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(ask, url)
            wait_until(lambda: metric(url, "gateway_queue_depth") == 1, what="the request to wait in the gateway")
            assert engine.chats == [], "never a guessed capacity: nothing is sent"
            engine.props_status = 200  # the next health round past its backoff reads it
            assert reply.result(timeout=30) == "hi"
        shown_ready = capacity_of(url, LLAMA)
        assert shown_ready["ready"] is True
        assert shown_ready["declared"] == {"max_concurrent": "auto", "kv_cache_tokens": "auto"}
        assert shown_ready["engine"] == {"max_concurrent": 3, "kv_cache_tokens": engine.kv_cache_tokens}
        assert metric(url, "gateway_backend_held", **unread) == 0
        assert metric(url, "gateway_fleet_quota_requests", backend=LLAMA) == 3, "the room dispatch uses: its slots"
    assert said(caplog, f"backend {LLAMA} is not ready") == 1, "said once, not at every retry"
    assert (
        said(
            caplog,
            f"backend {LLAMA} is now ready: its capacity from the engine: kv_cache_tokens 12288, max_concurrent 3",
        )
        == 1
    )


def test_a_replica_sharing_capacity_through_the_ledger_offers_it_the_engines_figure(
    start_gateway: StartGateway,
) -> None:
    engine = FakeLlamacpp(slots=3, props_status=503)
    prefix = unique_prefix()
    try:
        with serve_in_thread(engine) as engine_url:
            text = llamacpp_policy(engine_url, state=redis_state(REDIS_URL, prefix))
            with start_gateway(text) as url:
                wait_until(lambda: engine.props_reads >= 1, what="a first read of /props")
                assert metric(url, "gateway_fleet_quota_requests", backend=LLAMA) == 0, "unread: nothing to share"
                engine.props_status = 200
                wait_until(
                    lambda: metric(url, "gateway_fleet_quota_requests", backend=LLAMA) == 3,
                    what="the ledger's grant of the engine's 3 slots (it shares what each replica reports)",
                )
                assert ask(url) == "hi"
    finally:
        drop_keys(REDIS_URL, prefix)
