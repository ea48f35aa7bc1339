"""Isolation end to end: the real simulated engine behind the gateway, its own hit counters."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import OMIT, backend, build_policy, model
from tests.servers import metric, serve_in_thread

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "You are the support assistant of a company that sells garden tools and answers briefly. " * 12


def policy(engine_url: str) -> str:
    return build_policy(
        version="sim-isolation",
        classes={"batch": OMIT},
        models=[model(MODEL, max_prompt_tokens=8192)],
        backends=[backend("engine", engine_url, [MODEL], kind="sim")],
        tenants={"globex": {"models": ["*"], "default_class": "interactive"}},
    )


@pytest.fixture
def engine_url() -> Iterator[str]:
    with serve_in_thread(build_engine_app("llama-3.1-8b-h100", time_scale=0.01)) as url:
        yield url


def ask(gateway: str, tenant: str, **fields: object) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **fields}
    response = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer key-{tenant}"}, timeout=10
    )
    assert response.status_code == 200, response.text


def hits(engine: str) -> float:
    return metric(engine, "vllm:prefix_cache_hits_total")


def test_the_same_prompt_never_hits_across_tenants_and_hits_within_one(
    start_gateway: StartGateway, engine_url: str
) -> None:
    with start_gateway(policy(engine_url), health_checks=False) as gateway:
        ask(gateway, "acme")
        ask(gateway, "globex")
        across = hits(engine_url)
        ask(gateway, "globex", cache_salt="")  # a client's salt (even a blank one) is overwritten
        globex_again = hits(engine_url) - across
        ask(gateway, "acme", cache_salt="globex-guess")
        acme_again = hits(engine_url) - across - globex_again
    assert across == 0
    assert globex_again > 0
    assert acme_again == globex_again


def test_without_the_gateway_the_engine_would_share_the_prompt(engine_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    assert hits(engine_url) > 0
