"""The fleet's capacity through faults, with real gateway processes and a real redis-server.

A replica SIGKILLed gives its part back within the lease; a replica added takes its part; Redis
killed puts every replica on a fallback share that keeps the sum within the capacity, requests
keep being served, and coordination resumes by itself when Redis is back.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT_MODEL, KEY_ACME
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import RedisProcess, private_redis, unique_prefix
from tests.policy_builder import build_policy, redis_state
from tests.servers import ChildServer, metric, serve_in_process, serve_in_thread, wait_until

CAPACITY = 8
LEASE_S = 1.0


def policy(backend_url: str, redis_url: str, **sections: Any) -> str:
    return build_policy(
        backend_url,
        **sections,
        backends={"fake": {"capacity": {"max_concurrent": CAPACITY}}},
        state=redis_state(redis_url, unique_prefix(), timeout_ms=300),
        fleet={"sync_interval_s": 0.02, "lease_ttl_s": LEASE_S, "timeout_ms": 300, "processes_when_unknown": 2},
        health_checks={"interval_s": 60, "timeout_s": 1},
    )


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    with private_redis() as server:
        yield server


@pytest.fixture
def backend_url() -> Iterator[str]:
    with serve_in_thread(FakeBackend()) as url:
        yield url


@contextmanager
def replicas(text: str, count: int) -> Iterator[tuple[Path, list[ChildServer], ExitStack]]:
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        children = [stack.enter_context(replica(path)) for _ in range(count)]
        yield path, children, stack


def replica(path: Path) -> AbstractContextManager[ChildServer]:
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
    return serve_in_process([*argv, "--log-level", "info"])


def quota(child: ChildServer) -> float:
    return metric(child.admin_url, "gateway_fleet_quota_requests", backend="fake")


def processes(child: ChildServer) -> float:
    return metric(child.admin_url, "gateway_fleet_processes")


def ask(child: ChildServer) -> int:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    return httpx.post(f"{child.url}/v1/chat/completions", headers=headers, json=body, timeout=10).status_code


def test_a_replica_killed_gives_its_part_back_within_its_lease(redis_server: RedisProcess, backend_url: str) -> None:
    with replicas(policy(backend_url, redis_server.url), 2) as (_, (victim, survivor), _):
        wait_until(lambda: processes(survivor) == 2 and processes(victim) == 2, what="two replicas in the ledger")
        wait_until(lambda: quota(survivor) == CAPACITY // 2, what="the idle capacity split between them")
        victim.proc.kill()
        killed = time.monotonic()
        wait_until(lambda: quota(survivor) == CAPACITY, timeout=LEASE_S + 5, what="the dead replica's part back")
        assert time.monotonic() - killed <= LEASE_S + 1.5, "back within the lease (plus a sync or two)"
        assert processes(survivor) == 1


def test_a_replica_added_takes_its_part(redis_server: RedisProcess, backend_url: str) -> None:
    with replicas(policy(backend_url, redis_server.url), 1) as (path, (first,), stack):
        wait_until(lambda: quota(first) == CAPACITY, what="the first replica holding the whole capacity")
        second = stack.enter_context(replica(path))
        wait_until(lambda: quota(second) == CAPACITY // 2, what="the new replica taking its part")
        wait_until(lambda: quota(first) == CAPACITY // 2, what="the first giving it up")
        assert ask(second) == 200


def test_with_redis_killed_replicas_keep_serving_within_the_capacity_then_resume(
    redis_server: RedisProcess, backend_url: str
) -> None:
    with replicas(policy(backend_url, redis_server.url), 2) as (_, children, _):
        wait_until(lambda: all(processes(c) == 2 for c in children), what="two replicas in the ledger")
        wait_until(lambda: [quota(c) for c in children] == [CAPACITY // 2] * 2, what="the capacity split")
        redis_server.kill()
        wait_until(
            lambda: all(metric(c.admin_url, "gateway_fleet_syncs_total", result="failed") > 0 for c in children),
            what="both replicas on their fallback share",
        )
        assert [quota(c) for c in children] == [CAPACITY // 2] * 2, "each keeps its last part: the sum holds"
        assert [ask(c) for c in children] == [200, 200], "requests are served during the outage"
        ok_before = [metric(c.admin_url, "gateway_fleet_syncs_total", result="ok") for c in children]
        redis_server.start()
        wait_until(
            lambda: all(
                metric(c.admin_url, "gateway_fleet_syncs_total", result="ok") > before
                for c, before in zip(children, ok_before, strict=True)
            ),
            what="coordination resumed",
        )
        wait_until(lambda: all(processes(c) == 2 for c in children), what="both back in the ledger")
        assert sum(quota(c) for c in children) <= CAPACITY


def test_after_redis_lost_every_holding_no_replica_grabs_what_the_others_still_use(
    redis_server: RedisProcess,
) -> None:
    backend = FakeBackend()
    with serve_in_thread(backend) as backend_url:
        text = policy(backend_url, redis_server.url, classes={"interactive": {"queue": {"max_wait_s": 20}}})
        with replicas(text, 2) as (_, (first, second), _):
            wait_until(lambda: [quota(first), quota(second)] == [CAPACITY // 2] * 2, what="the capacity split")
            redis_server.kill()
            wait_until(
                lambda: (
                    min(metric(c.admin_url, "gateway_fleet_syncs_total", result="failed") for c in (first, second)) > 0
                ),
                what="both replicas frozen at their parts",
            )
            gate = backend.gate = threading.Event()
            held: list[threading.Thread] = []
            held += [threading.Thread(target=ask_stream, args=(second,)) for _ in range(CAPACITY // 2)]
            for thread in held:
                thread.start()
            wait_until(lambda: backend.active == CAPACITY // 2, what="the second replica's part in use")
            second.proc.send_signal(signal.SIGSTOP)  # the first reaches the new Redis, alone, meanwhile
            try:
                redis_server.start()  # empty: every holding is lost
                wait_until(lambda: processes(first) == 1, what="the first replica alone in the new ledger")
                more = [threading.Thread(target=ask_stream, args=(first,)) for _ in range(CAPACITY)]
                for thread in more:
                    thread.start()
                wait_until(
                    lambda: backend.active + metric(first.admin_url, "gateway_queue_depth") == CAPACITY * 3 // 2,
                    what="the first replica's requests served or waiting",
                )
                assert backend.most_active <= CAPACITY, "nobody was granted what another still had in flight"
            finally:
                second.proc.send_signal(signal.SIGCONT)
            backend.gate = None
            gate.set()
            for thread in held + more:
                thread.join(30)
    assert backend.most_active <= CAPACITY


def ask_stream(child: ChildServer) -> None:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    httpx.post(f"{child.url}/v1/chat/completions", headers=headers, json=body, timeout=60)
