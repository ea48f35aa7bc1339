"""A model group's engines keep tenants' caches apart for every API, shadow copies included.

The probe from outside, as a test: acme sends a secret system prompt to a model group with
Anthropic's SDK, then globex sends the very same prompt; the engine behind the group reports
how many prompt tokens it found in its prefix cache (``vllm:prefix_cache_hits_total``). vLLM's
own ``/v1/messages`` drops ``cache_salt``, so a Messages request that reached such an engine as
is would find acme's blocks for globex (3,024 cached tokens and a tenfold faster answer, seen).
The group's engine serves only the group's targets, which no tenant names: it must still count
as reached by both tenants' scopes, and their Messages requests, and the group's shadow copies
of them, must reach it translated to chat with each tenant's salt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from starlette.types import Receive, Scope, Send

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread, wait_until

GROUP = "assistant"
SERVED = "meta-llama/Llama-3.1-8B-Instruct"
SECRET = " ".join(f"clause {i}: the merger closes at {i * 37 % 1000} dollars a share." for i in range(90))


class PathRecorder:
    """An engine app that notes the path of every POST it serves (which API the gateway called)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture
def probed() -> Iterator[tuple[str, PathRecorder]]:
    """The engine under test: a real prefix cache that reports its hits."""
    recorder = PathRecorder(build_engine_app("llama-3.1-8b-h100", time_scale=0.01))
    with serve_in_thread(recorder) as url:
        yield url, recorder


@pytest.fixture
def other_engine() -> Iterator[str]:
    with serve_in_thread(build_engine_app("fixed", model=SERVED, ttft_ms=1, itl_ms=1)) as url:
        yield url


def group_policy(probed_url: str, other_url: str, *, shadowed: bool) -> str:
    """``assistant`` → ``v1`` on ``other``, shadowed to ``v2`` on the probed engine (``shadowed``);
    else ``assistant`` → ``v2``. Both tenants name the group alone."""
    limits = {"max_prompt_tokens": 8192, "max_output_tokens": 64, "upstream_name": SERVED}
    group: dict[str, Any] = {"name": GROUP, "targets": [{"model": "v2"}]}
    if shadowed:
        group = {"name": GROUP, "targets": [{"model": "v1"}], "shadow": {"model": "v2", "percent": 100}}
    return build_policy(
        version="group-isolation",
        models=[model("v1", **limits), model("v2", **limits)],
        backends=[backend("other", other_url, ["v1"], kind="sim"), backend("probed", probed_url, ["v2"], kind="sim")],
        model_groups=[group],
        tenants=[tenant("acme", KEY_ACME, models=[GROUP]), tenant("globex", KEY_GLOBEX, models=[GROUP])],
        retry={"max_retries": 0},
    )


def ask(gateway: str, key: str) -> None:
    with anthropic.Anthropic(base_url=gateway, api_key=key, max_retries=0, timeout=20) as client:
        answer = client.messages.create(
            model=GROUP, max_tokens=2, system=SECRET, messages=[{"role": "user", "content": "Summarise."}]
        )
    assert answer.usage.input_tokens > 512


def hits(engine: str) -> float:
    return metric(engine, "vllm:prefix_cache_hits_total")


def copies_done(gateway: str) -> float:
    return metric(gateway, "gateway_shadow_requests_total", group=GROUP, target="v2", outcome="completed")


def test_a_messages_prompt_sent_to_a_group_never_hits_another_tenants_cache(
    start_gateway: StartGateway, probed: tuple[str, PathRecorder], other_engine: str, tmp_path: Path
) -> None:
    engine, recorder = probed
    policy = group_policy(engine, other_engine, shadowed=False)
    with start_gateway(policy, health_checks=False, rollout_dir=str(tmp_path)) as gateway:
        ask(gateway, KEY_ACME)
        ask(gateway, KEY_GLOBEX)
        across = hits(engine)
        ask(gateway, KEY_ACME)  # the probe is sensitive: acme's own cache does serve acme
        again = hits(engine) - across
    assert across == 0
    assert again > 512
    assert recorder.paths == ["/v1/chat/completions"] * 3  # translated: the salt reached the engine


def test_shadow_copies_of_messages_requests_never_hit_another_tenants_cache(
    start_gateway: StartGateway, probed: tuple[str, PathRecorder], other_engine: str, tmp_path: Path
) -> None:
    engine, recorder = probed
    policy = group_policy(engine, other_engine, shadowed=True)
    with start_gateway(policy, health_checks=False, rollout_dir=str(tmp_path)) as gateway:
        for done, key in enumerate((KEY_ACME, KEY_GLOBEX, KEY_ACME), start=1):
            ask(gateway, key)
            wait_until(lambda done=done: copies_done(gateway) == done, what=f"shadow copy {done} completed")
            if done == 2:
                across = hits(engine)
        again = hits(engine) - across
    assert across == 0
    assert again > 512
    assert recorder.paths == ["/v1/chat/completions"] * 3
