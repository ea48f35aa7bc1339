"""A tenant at its concurrency limit, seen from two replicas sharing Redis: refused before its body.

Issue 28, "what was seen" 5: a tenant with rpm 120 and ``max_concurrent`` 2 sent 400 requests
in 4 s; each was refused ``tenant_concurrency_limited`` only after its body was read and Redis
asked, at no cost to its rpm. Now a concurrency refusal is remembered in the process for
``SLOT_REFUSAL_MEMORY_S``: the tenant's next requests are refused from their headers alone.

Two gateways share one Redis; the second reaches it through a proxy that counts the commands
it sends (``loadtests/harness/delay_proxy.py``): its admissions, and a few pings and ledger syncs.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from gateway.admission.tenant_limits import SLOT_REFUSAL_MEMORY_S
from loadtests.harness.delay_proxy import DelayProxy
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import redis_state, session_policy
from tests.servers import wait_until

AUTH = {"authorization": f"Bearer {KEY_ACME}"}
VALID = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
HELD = {**VALID, "stream": True}
REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
HAMMER = 200


@pytest.fixture
def prefix() -> Iterator[str]:
    value = unique_prefix()
    yield value
    drop_keys(REDIS_URL, value)


def policy(backend_url: str, redis_url: str, prefix: str) -> str:
    tenants = {"acme": {"limits": {"rpm": 120, "max_concurrent": 2}}}
    return session_policy(backend_url, tenants=tenants, state=redis_state(redis_url, prefix))


def code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"] if response.status_code != 200 else ""


def test_a_tenant_hammering_at_its_concurrency_limit_is_refused_before_its_body_on_another_replica(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway, prefix: str
) -> None:
    backend.tokens = 2
    backend.gate = threading.Event()  # streams hold their slot after the first chunk
    with DelayProxy(upstream_port=REDIS_PORT) as proxy:
        first_policy = policy(backend_server.url, REDIS_URL, prefix)
        second_policy = policy(backend_server.url, proxy.url, prefix)
        with (
            start_gateway(first_policy, health_checks=False) as first,
            start_gateway(second_policy, health_checks=False) as second,
            httpx.Client(headers=AUTH, timeout=10) as http,
        ):
            with (
                http.stream("POST", f"{first}/v1/chat/completions", json=HELD) as one,
                http.stream("POST", f"{first}/v1/chat/completions", json=HELD) as two,
            ):
                assert (one.status_code, two.status_code) == (200, 200)
                assert code(http.post(f"{second}/v1/chat/completions", json=VALID)) == (
                    429,
                    "tenant_concurrency_limited",
                )
                unread = http.post(f"{second}/v1/chat/completions", content=b"{" * 1000)
                assert code(unread) == (429, "tenant_concurrency_limited"), "the body was read"

                sent_before = proxy.sent
                answers = Counter(code(http.post(f"{second}/v1/chat/completions", json=VALID)) for _ in range(HAMMER))
                asked = proxy.sent - sent_before
                assert answers == {(429, "tenant_concurrency_limited"): HAMMER}
                assert asked < HAMMER / 4, f"{asked} Redis commands for {HAMMER} refusals"
            # Both streams closed by their client: the slots are free (on the first replica), and
            # the second replica sees it once its memory lapses.
            wait_until(
                lambda: http.post(f"{second}/v1/chat/completions", json=VALID).status_code == 200,
                timeout=max(5.0, 20 * SLOT_REFUSAL_MEMORY_S),
                what="the second replica to admit acme again",
            )
