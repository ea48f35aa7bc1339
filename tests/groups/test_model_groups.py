"""Model groups end to end: real simulated engines behind the gateway, the official SDK in front.

A group's public name is all a client sees (``/v1/models``, every answer's ``model``); its
targets share its traffic by weight; a target without room, dead, or refusing sends the
request down the fallback chain before any byte reached the client, and a client error never
does. The header ``x-gateway-target`` says which target answered.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway, closed_port_url
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, OMIT, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread

GROUP = "llama-3.1-8b"


@pytest.fixture
def engines() -> Iterator[dict[str, str]]:
    """Three fast engines, each serving its own name: ``served-a``, ``served-b``, ``served-c``."""
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                serve_in_thread(build_engine_app("fixed", model=f"served-{name}", ttft_ms=2, itl_ms=20))
            )
            for name in ("a", "b", "c")
        }
        yield urls


def group_policy(
    urls: dict[str, str],
    *,
    group: dict[str, Any],
    a_url: str | None = None,
    prices: tuple[float, float] = (0.0, 0.0),
    **sections: Any,
) -> str:
    """Targets ``t-a``, ``t-b``, ``t-c`` (served as ``served-<x>``), one sim backend each, and
    ``group``; ``prices`` of engine-a and engine-b per GPU-hour."""
    return build_policy(
        version="groups-1",
        models=[
            model(f"t-{name}", upstream_name=f"served-{name}", max_prompt_tokens=4096, max_output_tokens=512)
            for name in ("a", "b", "c")
        ]
        + [model("plain", upstream_name="served-c", max_prompt_tokens=4096, max_output_tokens=512)],
        backends=[
            backend(
                "engine-a",
                a_url or urls["a"],
                ["t-a"],
                kind="sim",
                capacity={"max_concurrent": 1},
                price_per_gpu_hour=prices[0],
            ),
            backend("engine-b", urls["b"], ["t-b"], kind="sim", price_per_gpu_hour=prices[1]),
            backend("engine-c", urls["c"], ["t-c", "plain"], kind="sim"),
        ],
        model_groups=[{"name": GROUP, **group}],
        tenants=[
            tenant("acme", KEY_ACME),
            tenant("globex", KEY_GLOBEX, models=[GROUP], allow_costlier_fallback=False),
        ],
        **{"retry": {"max_retries": 2, "budget_min_per_s": 100}, "breaker": OMIT, **sections},
    )


def sdk(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def ask(client: openai.OpenAI, **fields: Any) -> tuple[str | None, str | None, Any]:
    """One chat completion: (target header, fallback header, the parsed completion)."""
    raw = client.chat.completions.with_raw_response.create(
        model=fields.pop("model", GROUP), messages=[{"role": "user", "content": "hello there"}], max_tokens=2, **fields
    )
    return raw.headers.get("x-gateway-target"), raw.headers.get("x-gateway-fallback"), raw.parse()


def served(engine_url: str) -> float:
    return metric(engine_url, "vllm:request_success_total", finished_reason="length") + metric(
        engine_url, "vllm:request_success_total", finished_reason="stop"
    )


def test_weights_split_the_traffic_and_the_client_only_sees_the_public_name(
    start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path
) -> None:
    group = {"targets": [{"model": "t-a", "weight": 3}, {"model": "t-b", "weight": 1}]}
    requests = 400
    with start_gateway(group_policy(engines, group=group), health_checks=False, rollout_dir=str(tmp_path)) as url:
        client = sdk(url)
        targets: Counter[str | None] = Counter()
        for _ in range(requests):
            target, fallback, completion = ask(client)
            targets[target] += 1
            assert fallback is None
            assert completion.model == GROUP  # the engine said served-a or served-b
        stream = client.chat.completions.create(
            model=GROUP, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        chunks = list(stream)
        listed = [m.id for m in client.models.list()]
    assert {c.model for c in chunks} == {GROUP}
    assert sorted(listed) == sorted([GROUP, "plain", "t-c"])  # t-a and t-b serve the group: internal
    # Binomial(400, 0.75): a split within 4 standard deviations of 300 (a false failure ~ 1 in 15,000).
    spread = 4 * math.sqrt(requests * 0.75 * 0.25)
    assert abs(targets["t-a"] - 300) <= spread, targets
    assert targets["t-a"] + targets["t-b"] == requests
    assert served(engines["a"]) - targets["t-a"] in (0, 1)  # the header told the truth (the stream went to one)
    assert served(engines["a"]) + served(engines["b"]) == requests + 1


def test_a_target_is_not_callable_by_name(start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path) -> None:
    group = {"targets": [{"model": "t-a"}]}
    with start_gateway(group_policy(engines, group=group), health_checks=False, rollout_dir=str(tmp_path)) as url:
        with pytest.raises(openai.NotFoundError) as refused:
            ask(sdk(url), model="t-a")
        _, _, plain = ask(sdk(url), model="plain")
    assert refused.value.code == "model_not_found"
    assert plain.model == "plain"  # an upstream_name is renamed back too


def test_a_full_primary_falls_back_at_once(
    start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path
) -> None:
    group = {"targets": [{"model": "t-a"}], "fallbacks": ["t-b"], "fallback_wait_s": 0}
    with start_gateway(group_policy(engines, group=group), health_checks=False, rollout_dir=str(tmp_path)) as url:
        client = sdk(url)
        holding = client.chat.completions.create(
            model=GROUP, messages=[{"role": "user", "content": "hold"}], max_tokens=200, stream=True
        )
        first = next(iter(holding))  # engine-a's one slot is taken until this stream ends
        target, fallback, completion = ask(client)
        holding.close()
        fallbacks = metric(
            url, "gateway_fallbacks_total", group=GROUP, from_target="t-a", to_target="t-b", reason="no_room"
        )
    assert first.model == GROUP
    assert (target, fallback) == ("t-b", "no_room")
    assert completion.model == GROUP
    assert fallbacks == 1


def test_a_dead_primary_falls_back(start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path) -> None:
    group = {"targets": [{"model": "t-a"}], "fallbacks": ["t-b"]}
    text = group_policy(engines, group=group, a_url=closed_port_url())
    with start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)) as url:
        first = ask(sdk(url))
        second = ask(sdk(url))  # engine-a is marked down now: no attempt on it at all
    assert first[:2] == ("t-b", "failed")
    assert second[:2] == ("t-b", "unavailable")


def test_a_refusing_primary_falls_back_and_a_client_error_does_not(
    start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path
) -> None:
    group = {"targets": [{"model": "t-a"}], "fallbacks": ["t-b"]}
    httpx.post(f"{engines['a']}/admin/fault", json={"mode": "fail_503"}).raise_for_status()
    with start_gateway(group_policy(engines, group=group), health_checks=False, rollout_dir=str(tmp_path)) as url:
        refused = ask(sdk(url))
        httpx.post(f"{engines['a']}/admin/fault", json={"mode": "none"}).raise_for_status()
        before_b = served(engines["b"])
        with pytest.raises(openai.BadRequestError):
            ask(sdk(url), n=2)  # the engine refuses n=2: the client's error, not the target's
        after_b = served(engines["b"])
    assert refused[:2] == ("t-b", "refused")
    assert after_b == before_b


def test_a_tenant_denied_costlier_fallback_is_not_sent_there(
    start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path
) -> None:
    group = {"targets": [{"model": "t-a"}], "fallbacks": ["t-b"], "fallback_wait_s": 0}
    priced = group_policy(engines, group=group, prices=(2.0, 8.0))
    with start_gateway(priced, health_checks=False, rollout_dir=str(tmp_path)) as url:
        holding = sdk(url).chat.completions.create(
            model=GROUP, messages=[{"role": "user", "content": "hold"}], max_tokens=200, stream=True
        )
        next(iter(holding))
        acme = ask(sdk(url))  # acme may go to the dearer target
        with pytest.raises(openai.APIStatusError) as globex:
            ask(sdk(url, KEY_GLOBEX))  # globex may not: the primary's own overload answer
        holding.close()
    assert acme[:2] == ("t-b", "no_room")
    assert globex.value.status_code == 503


def test_fallback_spends_the_retry_budget(start_gateway: StartGateway, engines: dict[str, str], tmp_path: Path) -> None:
    """With no retry budget, a full primary is the client's 503: fallbacks never amplify an overload."""
    group = {"targets": [{"model": "t-a"}], "fallbacks": ["t-b"], "fallback_wait_s": 0}
    text = group_policy(engines, group=group, retry={"max_retries": 2, "budget_ratio": 0, "budget_min_per_s": 0})
    with start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)) as url:
        holding = sdk(url).chat.completions.create(
            model=GROUP, messages=[{"role": "user", "content": "hold"}], max_tokens=200, stream=True
        )
        next(iter(holding))
        with pytest.raises(openai.APIStatusError) as refused:
            ask(sdk(url))
        holding.close()
        exhausted = metric(url, "gateway_retry_budget_exhausted_total", model="t-a")
    assert refused.value.status_code == 503
    assert exhausted == 1
