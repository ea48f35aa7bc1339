"""A backend's ``capacity`` in a policy file: ``auto`` (whole or per field), its defaults, and the
figures a kind of engine never publishes, refused at load and at reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.policy.loader import PolicyError
from gateway.policy.model import Capacity
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.timescale import scale_policy_time
from gateway.service import POLICY_LOADER, Gateway, ReloadRefused, parse_policy
from gateway.settings import Settings
from tests.policy_builder import CHAT_MODEL, backend, build_policy, model


def policy(kind: str, capacity: Any) -> str:
    engine = backend("e1", "http://127.0.0.1:1", [CHAT_MODEL], kind=kind, capacity=capacity)
    return build_policy(backends=[engine], models=[model(CHAT_MODEL)])


def capacity_of(text: str) -> Capacity:
    return parse_policy(text, "policy.yaml").policy.backends[0].capacity


def test_auto_alone_takes_both_figures_from_the_engine_and_leaves_the_rest_at_their_defaults() -> None:
    capacity = capacity_of(policy("llamacpp", "auto"))
    assert capacity.from_engine == {"max_concurrent", "kv_cache_tokens"}
    assert capacity.awaiting_engine == ("max_concurrent", "kv_cache_tokens")
    assert (capacity.max_concurrent, capacity.kv_cache_tokens) == (0, None), "no room for any reader until read"
    assert (capacity.max_tokens_in_flight, capacity.max_waiting, capacity.max_kv_usage) == (1_000_000, 0, 0.97)


def test_auto_per_field_keeps_every_other_field_settable() -> None:
    written = {"max_concurrent": 32, "kv_cache_tokens": "auto", "max_waiting": 2, "max_tokens_in_flight": 9000}
    capacity = capacity_of(policy("vllm", written))
    assert capacity.from_engine == {"kv_cache_tokens"}
    assert capacity.awaiting_engine == ("kv_cache_tokens",)
    assert (capacity.max_concurrent, capacity.max_waiting, capacity.max_tokens_in_flight) == (32, 2, 9000)
    read = capacity.with_engine(None, 65_536)
    assert (read.max_concurrent, read.kv_cache_tokens, read.awaiting_engine) == (32, 65_536, ())
    assert read.as_written == capacity


def test_the_engine_queue_holds_dispatch_by_default() -> None:
    assert Capacity().max_waiting == 0
    assert capacity_of(policy("vllm", {"max_concurrent": 8})).max_waiting == 0


def test_a_policy_with_auto_survives_a_round_trip_through_its_dump() -> None:
    snapshot = parse_policy(policy("llamacpp", {"max_concurrent": "auto", "max_waiting": 3}), "policy.yaml")
    scaled = scale_policy_time(snapshot, 4)  # dumped, edited, loaded again
    assert scaled.policy.backends[0].capacity == snapshot.policy.backends[0].capacity
    assert snapshot.policy.backends[0].capacity.model_dump()["max_concurrent"] == "auto"


@pytest.mark.parametrize(
    ("kind", "capacity", "problem"),
    [
        pytest.param(
            "vllm",
            {"max_concurrent": "auto"},
            "policy.yaml: backends[e1].capacity.max_concurrent: auto, but an engine of kind vllm does not publish it; "
            "declare it as a number (for vLLM and the simulator: their --max-num-seqs)",
            id="vLLM does not publish its --max-num-seqs",
        ),
        pytest.param(
            "openai",
            "auto",
            "policy.yaml: backends[e1].capacity.kv_cache_tokens: auto, but an engine of kind openai does not publish "
            "it; declare it as a number (the KV-cache size the engine logs at start), or leave it out",
            id="an OpenAI-compatible server publishes nothing",
        ),
        pytest.param(
            "vllm",
            {"max_concurrent": 0},
            "policy.yaml:24:21: backends[e1].capacity.max_concurrent: must be greater than 0, or auto (the engine's "
            "own figure)",
            id="max_concurrent 0 is not a way to write auto",
        ),
    ],
)
def test_a_figure_that_cannot_come_from_the_engine_is_refused_at_load(kind: str, capacity: Any, problem: str) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(policy(kind, capacity), "policy.yaml")
    assert problem in str(refused.value).splitlines()


def test_a_reload_asking_an_engine_for_a_figure_it_does_not_publish_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy("vllm", {"max_concurrent": 8, "kv_cache_tokens": "auto"}))
    gateway = Gateway(Settings(policy_path=str(path), health_checks=False), parse_policy(path.read_text(), str(path)))
    unpublished: PolicySnapshot = POLICY_LOADER.parse(policy("vllm", "auto"), str(path))  # the loader alone passes it
    with pytest.raises(
        ReloadRefused, match=r"backends\[e1\]\.capacity\.max_concurrent: auto, but an engine of kind vllm"
    ):
        gateway.install(unpublished)
    assert gateway.policy().policy.backends[0].capacity.max_concurrent == 8, "the policy in force stays"
