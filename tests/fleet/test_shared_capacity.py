"""Two gateways in front of one backend behave as one: its capacity holds across them.

Real parts: a fake backend that counts the requests it answers at once, two gateways (two
``Gateway`` objects, each with its own dispatcher, queues and ledger process id) sharing the
real Redis, the official SDK as clients. Without a shared store, ``workers`` partitions the
capacity; with Redis unreachable, each gateway falls back to a share that keeps the sum.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.service import parse_policy
from gateway.settings import Settings
from tests.conftest import CHAT_MODEL, KEY_ACME
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import build_policy, redis_state
from tests.servers import free_port, metric, serve_gateway_in_thread, serve_in_thread, wait_until

CAPACITY = 2


def fleet_policy(backend_url: str, state: dict[str, Any] | None = None, **fleet: Any) -> str:
    """One backend of capacity 2; requests may wait 20 s for it (the test holds them)."""
    sections: dict[str, Any] = {
        "backends": {"fake": {"capacity": {"max_concurrent": CAPACITY}}},
        "classes": {"interactive": {"queue": {"max_wait_s": 20}}},
        "fleet": {"sync_interval_s": 0.02, "lease_ttl_s": 1.0, "timeout_ms": 1000, **fleet},
        "health_checks": {"interval_s": 60, "timeout_s": 1},
    }
    if state is not None:
        sections["state"] = state
    return build_policy(backend_url, **sections)


@contextmanager
def gateways(text: str, count: int, **settings: Any) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        urls = []
        for _ in range(count):
            config = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0, **settings)
            urls.append(stack.enter_context(serve_gateway_in_thread(config, parse_policy(text, str(path)))).api_url)
        yield urls


@pytest.fixture
def fake() -> Iterator[tuple[FakeBackend, str]]:
    backend = FakeBackend()
    with serve_in_thread(backend) as url:
        yield backend, url


def stream(url: str, answers: list[int]) -> None:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    answers.append(httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body, timeout=30).status_code)


def sdk_stream(url: str, answers: list[str]) -> None:
    """One short stream through the official SDK; its text goes to ``answers``."""
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30)
    chunks = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    answers.append("".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices))


@contextmanager
def held(backend: FakeBackend, send: Callable[[str], None], urls: list[str], count: int) -> Iterator[None]:
    """``count`` requests sent through ``urls`` in turn, each held by the backend until the block
    ends (its gate), then let go and waited for."""
    gate = backend.gate = threading.Event()
    senders = [threading.Thread(target=send, args=(urls[i % len(urls)],)) for i in range(count)]
    for sender in senders:
        sender.start()
    try:
        yield
    finally:
        backend.gate = None
        gate.set()
        for sender in senders:
            sender.join(30)


def test_two_gateways_never_send_a_backend_more_than_its_capacity_and_answer_everyone(
    fake: tuple[FakeBackend, str],
) -> None:
    backend, backend_url = fake
    prefix = unique_prefix()
    answers: list[int] = []
    try:
        with (
            gateways(fleet_policy(backend_url, redis_state(REDIS_URL, prefix)), 2) as urls,
            held(backend, lambda url: stream(url, answers), urls, 6),
        ):
            queued = lambda: sum(metric(url, "gateway_queue_depth") for url in urls)  # noqa: E731
            wait_until(lambda: backend.active == CAPACITY and queued() == 6 - CAPACITY, what="two served, four queued")
    finally:
        drop_keys(REDIS_URL, prefix)
    assert sorted(answers) == [200] * 6, "everyone answered, in turn"
    assert backend.most_active == CAPACITY, "the backend never held more than its capacity"


def test_workers_without_a_shared_store_each_take_their_share(fake: tuple[FakeBackend, str]) -> None:
    _, backend_url = fake
    with gateways(fleet_policy(backend_url), 1, workers=2) as (url,):
        assert metric(url, "gateway_fleet_quota_requests", backend="fake") == CAPACITY // 2
        assert metric(url, "gateway_fleet_processes") == 2


@pytest.mark.parametrize(
    ("assumed", "part"),
    [
        pytest.param(None, 0, id="a gateway that never reached the ledger holds nothing"),
        pytest.param(4, 8 // 4, id="with processes_when_unknown it takes a share of the processes assumed"),
    ],
)
def test_a_gateway_that_never_reached_the_ledger_holds_nothing_unless_told_how_many_run(
    fake: tuple[FakeBackend, str], assumed: int | None, part: int
) -> None:
    """Without the ledger a process cannot know what the others hold: anything it took could be
    in use elsewhere. Only an operator's bound on how many run without it makes a share safe."""
    _, backend_url = fake
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    fleet = {} if assumed is None else {"processes_when_unknown": assumed}
    text = fleet_policy(backend_url, redis_state(unreachable, unique_prefix()), **fleet)
    text = text.replace("max_concurrent: 2", "max_concurrent: 8")
    with gateways(text, 1) as (url,):
        wait_until(lambda: metric(url, "gateway_fleet_syncs_total", result="failed") >= 1, what="a failed sync")
        assert metric(url, "gateway_fleet_quota_requests", backend="fake") == part
