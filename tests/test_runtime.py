"""A reload is one computed swap: all of a new policy applies, or none of it; attempts never share a body.

The three defects the old shape caused, each proven against real servers: a reload to another
routing strategy routes by it; a valid policy that cannot be applied (a backend's credential
is unset) changes nothing and says why; a retry to a backend of another kind carries none of
the fields the first backend needed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.service import load_policy
from gateway.settings import Settings
from tests.conftest import KEY_ACME, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import NOWHERE, OMIT, admin_keys, backend, build_policy, model
from tests.servers import admin_url, samples, serve_gateway_in_thread, serve_in_thread, wait_until

ADMIN_KEY = "admin-key-for-reload-tests"
MODEL = "m/chat"
UNSET_ENV = "GATEWAY_TEST_NEVER_SET_CREDENTIAL"


def policy(
    specs: list[tuple[str, str, str]], *, version: str = "r-1", strategy: str = "prefix_affinity", **sections: Any
) -> str:
    """A policy over ``specs`` of backends as (name, url, kind[, credential_env]) with one model and one tenant;
    ``sections`` edit it (``tests/policy_builder.py``)."""
    entries = [
        backend(name, url, [MODEL], kind=kind, **({"credential_env": credential[0]} if credential else {}))
        for name, url, kind, *credential in specs
    ]
    reload = {
        "version": version,
        "classes": {"interactive": {"slo": {"ttft_ms": 5000, "itl_ms": 1000, "e2e_ms": 60000}}, "batch": OMIT},
        "models": [model(MODEL, max_output_tokens=64, routing={"strategy": strategy})],
        "backends": entries,
        "tenants": {"globex": OMIT},
        "admin": admin_keys(ADMIN_KEY),
        "lifecycle": {"watch_interval_s": 0},
        "health_checks": {"interval_s": 60, "timeout_s": 1},
        "breaker": {"consecutive_failures": None, "failure_ratio": None},
    }
    return build_policy(NOWHERE, reload, **sections)


@contextmanager
def fakes(count: int) -> Iterator[list[tuple[FakeBackend, str]]]:
    with ExitStack() as stack:
        servers = []
        for _ in range(count):
            fake = FakeBackend()
            servers.append((fake, stack.enter_context(serve_in_thread(fake))))
        yield servers


@contextmanager
def gateway(path: Path, text: str) -> Iterator[str]:
    path.write_text(text)
    settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0)
    with serve_gateway_in_thread(settings, load_policy(path)) as built:
        yield built.api_url


def reload(url: str) -> httpx.Response:
    return httpx.post(f"{admin_url(url)}/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})


def status(url: str) -> dict[str, object]:
    reply = httpx.get(f"{admin_url(url)}/admin/policy", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert isinstance(reply, dict)
    return reply


def ask(url: str, *, stream: bool = False, content: str = "the same prompt, every time") -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0) as client:
        messages = [{"role": "user", "content": content}]
        if stream:
            chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)  # type: ignore[arg-type]
            assert [c for c in chunks if c.choices]
        else:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]


def test_a_reload_to_another_routing_strategy_routes_by_it(tmp_path: Path) -> None:
    with (
        fakes(2) as servers,
        gateway(tmp_path / "p.yaml", policy([("a", servers[0][1], "vllm"), ("b", servers[1][1], "vllm")])) as url,
    ):
        for _ in range(6):
            ask(url)
        counts = sorted(len(fake.received) for fake, _ in servers)
        assert counts == [0, 6], "prefix affinity keeps one prompt on one backend"
        text = policy(
            [("a", servers[0][1], "vllm"), ("b", servers[1][1], "vllm")], version="r-2", strategy="round_robin"
        )
        (tmp_path / "p.yaml").write_text(text)
        assert reload(url).status_code == 200
        for fake, _ in servers:
            fake.received.clear()
        for _ in range(6):
            ask(url)
        assert [len(fake.received) for fake, _ in servers] == [3, 3], "round robin alternates after the reload"
        assert metric(url, "gateway_routing_decisions_total", strategy="round_robin") == 6


def test_a_reload_that_cannot_be_applied_changes_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(UNSET_ENV, raising=False)
    path = tmp_path / "p.yaml"
    with fakes(2) as servers, gateway(path, policy([("a", servers[0][1], "vllm")])) as url:
        ask(url)
        path.write_text(policy([("a", servers[0][1], "vllm"), ("b", servers[1][1], "vllm", UNSET_ENV)], version="r-2"))
        refused = reload(url)
        assert refused.status_code == 422
        said = status(url)
        assert said["version"] == "r-1"
        assert said["reloads"] == {"ok": 0, "invalid": 0, "refused": 1}
        assert re.search(
            rf"version r-2 is valid but cannot be applied: backend 'b': .*{UNSET_ENV} is not set",
            str(said["last_error"]),
        )
        assert metric(url, "gateway_policy_info", version="r-1") == 1
        assert metric(url, "gateway_policy_info", version="r-2") == 0
        assert metric(url, "gateway_policy_reloads", result="refused") == 1
        assert httpx.get(f"{admin_url(url)}/readyz").json() == {"ready": True, "policy_version": "r-1"}
        for _ in range(4):
            ask(url, content="any prompt")
        assert (len(servers[0][0].received), len(servers[1][0].received)) == (5, 0), "the old pool alone serves"

        monkeypatch.setenv(UNSET_ENV, "now-it-is-set")
        assert reload(url).status_code == 200
        assert status(url)["version"] == "r-2"
        wait_until(lambda: metric(url, "gateway_policy_info", version="r-2") == 1, what="the new version's info")


@pytest.mark.parametrize("stream", [False, True], ids=["a completion", "a stream"])
def test_a_retry_on_a_backend_of_another_kind_carries_nothing_of_the_first_attempt(
    tmp_path: Path, stream: bool
) -> None:
    with fakes(2) as servers:
        (vllm, vllm_url), (plain, plain_url) = servers
        vllm.status = 503
        text = policy(
            [("engine", vllm_url, "vllm"), ("plain", plain_url, "openai")],
            strategy="round_robin",
            retry={"max_retries": 1, "backoff_base_s": 0.001, "backoff_cap_s": 0.002},
        )
        with gateway(tmp_path / "p.yaml", text) as url:
            for _ in range(3):  # within the retry budget's floor of 3 retries a second
                ask(url, stream=stream)
    assert len(vllm.received) == 3, "round robin sends each request to the vLLM backend first (its 503 is retried)"
    assert all("cache_salt" in r.body for r in vllm.received), "the vLLM attempt was salted"
    assert len(plain.received) == 3
    for received in plain.received:
        assert "cache_salt" not in received.body
        assert "priority" not in received.body
        assert "continuous_usage_stats" not in (received.body.get("stream_options") or {})


def test_a_class_a_reload_adds_gets_a_queue_and_its_requests_wait_their_turn(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    one_slot = {"a": {"capacity": {"max_concurrent": 1}}}
    with fakes(1) as servers:
        fake, backend_url = servers[0]
        with gateway(path, policy([("a", backend_url, "vllm")], backends=one_slot)) as url:
            bulk = {"rank": 1, "slo": {"ttft_ms": 20000, "itl_ms": 1000, "e2e_ms": 60000}, "queue": {"max_wait_s": 20}}
            path.write_text(
                policy([("a", backend_url, "vllm")], version="r-2", backends=one_slot, classes={"bulk": bulk})
            )
            assert reload(url).status_code == 200
            gate = fake.gate = threading.Event()  # the one slot is held by a stream until the test opens it
            results: dict[str, int] = {}

            def send(name: str, headers: dict[str, str], stream: bool) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                answer = httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={"authorization": f"Bearer {KEY_ACME}", **headers},
                    json={**body, "stream": stream},
                    timeout=30,
                )
                results[name] = answer.status_code

            holder = threading.Thread(target=send, args=("holder", {}, True))
            holder.start()
            wait_until(lambda: len(fake.received) == 1, what="the stream holding the slot")
            waiter = threading.Thread(target=send, args=("bulk", {"x-priority": "bulk"}, False))
            waiter.start()
            wait_until(
                lambda: metric(url, "gateway_queue_depth", **{"class": "bulk"}) == 1, what="the bulk request queued"
            )
            fake.gate = None
            gate.set()
            holder.join(30)
            waiter.join(30)
    assert results == {"holder": 200, "bulk": 200}, "a class added by a reload queues like any other"


def test_a_backend_a_reload_removes_takes_its_series_with_it(tmp_path: Path) -> None:
    """An alert on a backend's health or breaker must stop for a backend that is gone, not show its
    last value until the process restarts (the runbook's GatewayBackendUnhealthy)."""
    with (
        fakes(2) as servers,
        gateway(tmp_path / "p.yaml", policy([("a", servers[0][1], "vllm"), ("b", servers[1][1], "vllm")])) as url,
    ):
        ask(url)
        for name in ("gateway_backend_healthy", "gateway_backend_in_flight_requests", "gateway_fleet_quota_requests"):
            assert {dict(labels)["backend"] for labels in samples(url, name)} == {"a", "b"}, name
        (tmp_path / "p.yaml").write_text(policy([("a", servers[0][1], "vllm")], version="r-2"))
        assert reload(url).status_code == 200
        for name in ("gateway_backend_healthy", "gateway_backend_in_flight_requests", "gateway_fleet_quota_requests"):
            assert {dict(labels)["backend"] for labels in samples(url, name)} == {"a"}, name
        class_series = samples(url, "gateway_class_in_flight_requests")
        assert class_series
        assert {dict(labels)["backend"] for labels in class_series} == {"a"}
        ask(url)  # the gateway still serves through the backend that stayed
