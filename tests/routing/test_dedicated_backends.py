"""Dedicated backends end to end: a tenant's requests reach only the backends that serve it.

Two fake llama.cpp backends behind a real gateway under ``cache_isolation.unsalted: dedicated``:
``llama-a`` serves acme only, ``llama-b`` globex only; ``test/other`` is served by ``llama-a``
alone, so globex has no backend for it. Every request sent is accounted for: its answer, and
the backend that received it (each carries its sender's name in its message).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.conftest import KEY_ACME, KEY_GLOBEX, StartGateway, closed_port_url, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import CHAT_MODEL, OMIT, OTHER_MODEL, backend, build_policy, model
from tests.servers import serve_in_thread, wait_until

KEYS = {"acme": KEY_ACME, "globex": KEY_GLOBEX}


def policy(url_a: str, url_b: str) -> str:
    return build_policy(
        version="dedicated-1",
        classes={"interactive": {"queue": {"max_wait_s": 30}}, "batch": OMIT},
        models=[model(CHAT_MODEL), model(OTHER_MODEL)],
        backends=[
            backend(
                "llama-a",
                url_a,
                [CHAT_MODEL, OTHER_MODEL],
                kind="llamacpp",
                tenants=["acme"],
                capacity={"max_concurrent": 1},
            ),
            backend("llama-b", url_b, [CHAT_MODEL], kind="llamacpp", tenants=["globex"]),
        ],
        cache_isolation={"unsalted": "dedicated"},
        scrape={"interval_s": 0},
        tenants={"globex": {"models": ["*"], "default_class": "interactive"}},
    )


@dataclass
class Pair:
    a: FakeBackend
    b: FakeBackend
    url_a: str
    url_b: str


@pytest.fixture
def pair() -> Iterator[Pair]:
    a, b = FakeBackend(), FakeBackend()
    with serve_in_thread(a) as url_a, serve_in_thread(b) as url_b:
        yield Pair(a, b, url_a, url_b)
        for fake in (a, b):
            gate, fake.gate = fake.gate, None
            if gate is not None:
                gate.set()


def senders(fake: FakeBackend) -> list[str]:
    return sorted(r.body["messages"][0]["content"] for r in fake.received)


def client(url: str, tenant: str, timeout: float = 10) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=timeout)


async def ask(sdk: openai.AsyncOpenAI, content: str, model: str = "test/chat") -> str:
    answer = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=4
    )
    return answer.choices[0].message.content or ""


async def test_two_tenants_requests_land_only_on_their_own_backends(start_gateway: StartGateway, pair: Pair) -> None:
    sent = {tenant: [f"{tenant} #{i}" for i in range(40)] for tenant in KEYS}
    pair.a.tokens = pair.b.tokens = 1
    with start_gateway(policy(pair.url_a, pair.url_b), health_checks=False) as url:
        async with client(url, "acme") as acme, client(url, "globex") as globex:
            answers = await asyncio.gather(
                *(ask(acme, content) for content in sent["acme"]),
                *(ask(globex, content) for content in sent["globex"]),
            )
    assert answers == [" tok"] * 80
    assert senders(pair.a) == sorted(sent["acme"])
    assert senders(pair.b) == sorted(sent["globex"])


async def test_a_tenant_whose_backend_is_full_never_holds_up_another_tenants_requests(
    start_gateway: StartGateway, pair: Pair
) -> None:
    """acme's only backend holds one request at a time; while one streams and another waits for
    it, globex's request is served by its own backend at once, not queued behind acme's."""
    pair.a.gate = threading.Event()
    with start_gateway(policy(pair.url_a, pair.url_b), health_checks=False) as url:
        async with client(url, "acme") as acme, client(url, "globex", timeout=5) as globex:
            stream = await acme.chat.completions.create(
                model="test/chat", messages=[{"role": "user", "content": "acme #0"}], max_tokens=4, stream=True
            )
            first = await anext(aiter(stream))  # acme #0 holds llama-a, stopped by the gate
            queued = asyncio.create_task(ask(acme, "acme #1"))
            await asyncio.to_thread(
                wait_until,
                lambda: metric(url, "gateway_queue_depth", model="test/chat") == 1,
                what="acme's second request to wait for llama-a",
            )
            assert await ask(globex, "globex #0") == " tok tok tok tok"
            assert not queued.done()
            gate, pair.a.gate = pair.a.gate, None
            gate.set()
            rest = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
            assert await queued == " tok tok tok tok"
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c or "" for c in rest) == " t0 t1 t2 t3"
    assert senders(pair.a) == ["acme #0", "acme #1"]
    assert senders(pair.b) == ["globex #0"]


async def test_a_tenant_whose_backend_is_down_is_refused_never_sent_to_another_tenants(
    start_gateway: StartGateway, pair: Pair
) -> None:
    text = policy(closed_port_url(), pair.url_b)
    with start_gateway(text, health_checks=False) as url:
        async with client(url, "acme") as acme, client(url, "globex") as globex:
            with pytest.raises(openai.InternalServerError) as refused:
                await ask(acme, "acme #0")
            assert await ask(globex, "globex #0") == " tok tok tok tok"
    assert refused.value.status_code == 503
    assert refused.value.code == "no_healthy_backend"
    assert senders(pair.b) == ["globex #0"]


async def test_a_tenant_with_no_backend_for_a_model_gets_503_at_once(start_gateway: StartGateway, pair: Pair) -> None:
    with start_gateway(policy(pair.url_a, pair.url_b), health_checks=False) as url:
        async with client(url, "globex") as globex:
            with pytest.raises(openai.InternalServerError) as refused:
                await ask(globex, "globex #0", model="test/other")
    assert refused.value.status_code == 503
    assert refused.value.code == "no_backend_for_tenant"
    assert "acme" not in str(refused.value.message)
    assert pair.a.received == pair.b.received == []
