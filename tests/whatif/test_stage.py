"""A staged side: the rewritten policy (engines, keys, times, state) loads with the gateway's own
loader, and its processes answer with the keys the replay knows, on the engines asked for."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.policy.loader import PolicyError
from gateway.request.keys import hash_api_key
from gateway.service import load_policy
from loadtests.harness.processes import metrics
from loadtests.whatif.model import ReplayRequest, StageSettings
from loadtests.whatif.stage import StageError, StagePlan, ports_needed, running, stage_policy, tenant_key
from loadtests.whatif.synth import CHAT_PATH, request_body, request_headers
from tests.policy_builder import NOWHERE, backend
from tests.whatif.conftest import MODEL, SLOS, request

WritePolicy = Callable[..., Path]


def plan_for(policy: Path, tmp_path: Path, port_base: int = 19100, **settings: Any) -> StagePlan:
    return stage_policy(
        policy, StageSettings(**{"profile": "fixed", **settings}), work_dir=tmp_path, port_base=port_base
    )


def test_each_backend_becomes_a_simulated_engine_of_the_same_name_capacity_and_price(
    write_policy: WritePolicy, tmp_path: Path
) -> None:
    capacity = {"max_concurrent": 7, "max_tokens_in_flight": 9000}
    policy = write_policy(backends={"sim-a": {"capacity": capacity, "price_per_gpu_hour": 3.5, "gpus": 2}})
    plan = plan_for(policy, tmp_path, port_base=19150)
    backends = {b.name: b for b in plan.snapshot.policy.backends}
    assert list(backends) == ["sim-a", "sim-b"]
    assert [e.port for e in plan.engines] == [19151, 19152]
    assert backends["sim-a"].url == "http://127.0.0.1:19151"
    assert {b.kind.value for b in backends.values()} == {"sim"}
    assert backends["sim-a"].capacity.max_concurrent == 7
    assert backends["sim-a"].capacity.max_tokens_in_flight == 9000
    assert (backends["sim-a"].price_per_gpu_hour, backends["sim-a"].gpus) == (3.5, 2)
    assert [(e.name, e.gpus, e.price_per_gpu_hour) for e in plan.engines] == [("sim-a", 2, 3.5), ("sim-b", 1, 2.0)]
    assert plan.gateway_port == 19150


def test_engines_n_makes_n_copies_of_the_models_first_backend(write_policy: WritePolicy, tmp_path: Path) -> None:
    plan = plan_for(write_policy(), tmp_path, engines=3)
    assert [b.name for b in plan.snapshot.policy.backends] == ["sim-a-0", "sim-a-1", "sim-a-2"]
    assert {e.source for e in plan.engines} == {"sim-a"}
    assert len({e.port for e in plan.engines}) == 3
    assert ports_needed(plan) == 4


def test_every_tenant_gets_a_key_the_replay_knows(write_policy: WritePolicy, tmp_path: Path) -> None:
    plan = plan_for(write_policy(), tmp_path)
    assert plan.keys == {"acme": tenant_key("acme"), "globex": tenant_key("globex")}
    assert plan.snapshot.tenants_by_key_hash[hash_api_key(plan.keys["acme"])].name == "acme"
    assert hash_api_key("unused-a") not in plan.snapshot.tenants_by_key_hash


def test_the_written_file_is_what_the_gateway_loads(write_policy: WritePolicy, tmp_path: Path) -> None:
    plan = plan_for(write_policy(), tmp_path, speed=2.0)
    assert plan.policy_path.parent == tmp_path
    assert load_policy(plan.policy_path).policy == plan.snapshot.policy


def test_speed_divides_every_time_of_the_policy_and_multiplies_the_rates(
    write_policy: WritePolicy, tmp_path: Path
) -> None:
    policy = write_policy(tenants={"acme": {"limits": {"rpm": 60, "tpm": 1000}}})
    plan = plan_for(policy, tmp_path, speed=4.0)
    interactive = plan.snapshot.policy.classes["interactive"]
    assert interactive.slo.ttft_ms == SLOS["interactive"]["ttft_ms"] / 4
    assert interactive.slo.itl_ms == SLOS["interactive"]["itl_ms"] / 4
    assert interactive.queue.max_wait_s == 10 / 4
    assert interactive.deadline_s == 600 / 4
    acme = next(t for t in plan.snapshot.policy.tenants if t.name == "acme")
    assert (acme.limits.rpm, acme.limits.tpm) == (240, 4000)
    assert plan.snapshot.models[MODEL].routing.index.ttl_s == 600 / 4
    assert plan.original.policy.classes["interactive"].slo.ttft_ms == SLOS["interactive"]["ttft_ms"]


def test_redis_state_is_staged_in_memory_and_said_so(write_policy: WritePolicy, tmp_path: Path) -> None:
    policy = write_policy(state={"backend": "redis", "redis_url": "redis://127.0.0.1:1/0"})
    plan = plan_for(policy, tmp_path)
    assert plan.snapshot.policy.state.backend == "memory"
    assert any("in-memory" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"profile": "no-such-profile"}, "unknown simulator profile 'no-such-profile'; known: fixed"),
        ({"profile": "fixed", "speed": 0.0}, "speed must be positive"),
        ({"profile": "fixed", "engines": 0}, "engines must be at least 1"),
    ],
    ids=["an unknown profile", "a zero speed", "no engines"],
)
def test_bad_settings_are_refused_with_the_reason(
    write_policy: WritePolicy, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(StageError, match=message):
        stage_policy(write_policy(), StageSettings(**settings), work_dir=tmp_path, port_base=19100)


def test_a_backend_serving_two_models_cannot_be_one_engine(write_policy: WritePolicy, tmp_path: Path) -> None:
    models = [{"name": MODEL}, {"name": "other"}]
    policy = write_policy(models=models, backends=[backend("both", NOWHERE, [MODEL, "other"], kind="sim")])
    with pytest.raises(StageError, match="backend 'both' serves several models"):
        plan_for(policy, tmp_path)


def test_a_policy_the_gateway_refuses_is_refused_with_the_loaders_message(
    write_policy: WritePolicy, tmp_path: Path
) -> None:
    with pytest.raises(PolicyError, match=r"tenants\[acme\].limits.rpm"):
        plan_for(write_policy(tenants={"acme": {"limits": {"rpm": 0}}}), tmp_path)


def send(plan: StagePlan, replayed: ReplayRequest, index: int, *, tenant: str) -> tuple[int, dict[str, Any]]:
    """One non-streamed replayed request through the staged gateway: its status and JSON body."""
    headers = request_headers(replayed, api_key=plan.keys[tenant], send_class=None)
    call = urllib.request.Request(plan.gateway_url + CHAT_PATH, data=request_body(replayed, index), headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=10) as response:
            return int(response.status), orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def test_a_running_stage_serves_every_tenant_on_its_n_engines_and_stops(
    write_policy: WritePolicy, tmp_path: Path, ports: Callable[[int], int]
) -> None:
    plan = plan_for(write_policy(), tmp_path, port_base=ports(4), engines=3)
    with running(plan):
        for tenant in ("acme", "globex"):
            status, body = send(plan, request(0.0, tenant=tenant, stream=False, output_tokens=3), 0, tenant=tenant)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 3
        healthy = [v for (name, _), v in metrics(plan.admin_url).items() if name == "gateway_backend_healthy"]
        assert healthy == [1.0, 1.0, 1.0]
    for url in [plan.gateway_url, *(e.url for e in plan.engines)]:
        with pytest.raises(urllib.error.URLError, match="refused"):
            urllib.request.urlopen(url + "/health", timeout=1)


def test_a_shared_hash_head_is_cached_by_the_engine_and_never_across_tenants(
    write_policy: WritePolicy, tmp_path: Path, ports: Callable[[int], int]
) -> None:
    plan = plan_for(write_policy(), tmp_path, port_base=ports(2), engines=1)
    shared = ("a0a0a0a0a0a0a0a0", "b1b1b1b1b1b1b1b1", "c2c2c2c2c2c2c2c2")
    first = request(0.0, stream=False, prompt_tokens=100, hashes=shared[:2])
    second = request(1.0, stream=False, prompt_tokens=120, hashes=shared)
    with running(plan):
        _, one = send(plan, first, 0, tenant="acme")
        _, two = send(plan, second, 1, tenant="acme")
        # The same ids under another tenant (which a trace never has: its chains are tenant-scoped).
        _, other = send(plan, second, 1, tenant="globex")
    # vLLM's usage: prompt_tokens_details is null when nothing was reused
    assert one["usage"]["prompt_tokens_details"] is None
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 16
    assert other["usage"]["prompt_tokens_details"] is None
