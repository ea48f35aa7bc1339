"""Fair queuing holds across replicas: a tenant that floods one gateway does not take the
capacity a light tenant needs on another.

Real parts: a fake backend whose streams hold their slot until the test opens a gate, two
gateways (two ``Gateway`` objects, each with its own dispatcher, queues and ledger process id)
sharing the real Redis under a key prefix of their own, the official SDK as clients. The
ledger shares each class's capacity max-min fairly across the tenants the processes report
(``gateway/fleet/ledger.py``, rule 2). Before, it moved capacity by each process's demand: the
flooding gateway refilled every slot the moment one ended, and the light tenant's request on
the other gateway waited for the whole flood.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest

from gateway.service import parse_policy
from gateway.settings import Settings
from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import build_policy, redis_state
from tests.servers import metric, serve_gateway_in_thread, serve_in_thread, wait_until

CAPACITY = 4
FLOOD = 12


def fair_policy(backend_url: str, prefix: str) -> str:
    """One backend of capacity 4; two interactive tenants (acme floods, globex is light)."""
    return build_policy(
        backend_url,
        backends={"fake": {"capacity": {"max_concurrent": CAPACITY}}},
        classes={"interactive": {"queue": {"max_wait_s": 30, "max_depth": 64}}},
        tenants={"globex": {"models": ["*"], "default_class": "interactive"}},
        fleet={"sync_interval_s": 0.02, "lease_ttl_s": 1.0, "timeout_ms": 1000},
        health_checks={"interval_s": 60, "timeout_s": 1},
        state=redis_state(REDIS_URL, prefix),
    )


@contextmanager
def two_gateways(text: str) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        urls = []
        for _ in range(2):
            config = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0)
            urls.append(stack.enter_context(serve_gateway_in_thread(config, parse_policy(text, str(path)))).api_url)
        yield urls


@pytest.fixture
def fake() -> Iterator[tuple[FakeBackend, str]]:
    backend = FakeBackend()
    backend.tokens = 2  # one content chunk after the first: one opening of the gate ends a stream
    with serve_in_thread(backend) as url:
        yield backend, url


class Streams:
    """Streams sent through the SDK in threads, each marked with its tenant in its prompt."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.done: dict[str, list[str]] = {"heavy": [], "light": []}

    def send(self, url: str, tenant: str) -> threading.Thread:
        key = KEY_ACME if tenant == "heavy" else KEY_GLOBEX

        def run() -> None:
            with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30) as sdk:
                chunks = sdk.chat.completions.create(
                    model=CHAT_MODEL, messages=[{"role": "user", "content": tenant}], max_tokens=4, stream=True
                )
                text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            self.done[tenant].append(text)

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        return thread


def received(backend: FakeBackend, tenant: str) -> int:
    return sum(1 for r in backend.received if r.body.get("messages", [{}])[0].get("content") == tenant)


def quota(url: str) -> float:
    return metric(url, "gateway_fleet_quota_requests", backend="fake")


def ended(backend: FakeBackend) -> int:
    return len(backend.received) - backend.active


def first_light_at(backend: FakeBackend) -> int | None:
    """How many heavy requests the backend had received before the first light one (None: none yet)."""
    heavy = 0
    for r in list(backend.received):
        content = r.body.get("messages", [{}])[0].get("content")
        if content == "light":
            return heavy
        heavy += content == "heavy"
    return None


def test_a_light_tenant_on_another_gateway_is_served_before_a_neighbours_flood_drains(
    fake: tuple[FakeBackend, str],
) -> None:
    backend, backend_url = fake
    prefix = unique_prefix()
    gate = backend.gate = threading.Event()
    streams = Streams()
    try:
        with two_gateways(fair_policy(backend_url, prefix)) as (flooded, light):
            wait_until(lambda: quota(flooded) + quota(light) == CAPACITY, what="both gateways hold a part")
            for _ in range(FLOOD):
                streams.send(flooded, "heavy")
            wait_until(
                lambda: backend.active == CAPACITY and metric(flooded, "gateway_queue_depth") == FLOOD - CAPACITY,
                what="the flood holding every slot, the rest queued",
            )
            streams.send(light, "light")
            wait_until(lambda: quota(flooded) <= CAPACITY - 2, what="the flooded gateway told to shrink to its share")
            # The four streams end; the flooded gateway restarts only its share, the light tenant gets the rest.
            while (before := ended(backend)) < CAPACITY:
                gate.set()
                wait_until(lambda: ended(backend) > before, what="a stream to end")
            wait_until(lambda: received(backend, "light") == 1, what="the light tenant's request on the backend")
            heavy_first = first_light_at(backend)
            assert heavy_first is not None
            assert heavy_first < FLOOD, f"{heavy_first} heavy requests went first"
            assert metric(flooded, "gateway_queue_depth") > 0, "while the flood still waits"

            # Served lately and idle now, the light tenant keeps a slot for its next arrival.
            while not streams.done["light"]:
                gate.set()
                wait_until(lambda: bool(streams.done["light"]) or not gate.is_set(), what="the gate taken")
            assert metric(flooded, "gateway_queue_depth") > 0, "the flood still waits"
            wait_until(lambda: quota(light) >= 1, what="headroom for the light tenant's next arrival")
            streams.send(light, "light")
            wait_until(lambda: received(backend, "light") == 2, what="the light tenant's next request at once")
            backend.gate = None
            gate.set()
            for thread in streams.threads:
                thread.join(30)
    finally:
        backend.gate = None
        gate.set()
        drop_keys(REDIS_URL, prefix)
    assert len(streams.done["heavy"]) == FLOOD, "every stream answered in full"
    assert len(streams.done["light"]) == 2
    assert backend.most_active <= CAPACITY, "the backend never held more than its capacity"
