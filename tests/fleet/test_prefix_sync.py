"""Gateways sharing Redis share their prefix view: one's decision is another's prefix match.

Real parts: two fake backends, gateways (each its own ``Gateway``, dispatcher, router and
Redis clients, with its own process id in the fleet) on loopback ports, the real Redis, the
official SDK as client. A conversation's first turn goes through one gateway; its next turn,
through another, must find the prefix there (``prefix_match``) and go to the same backend.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.dialects.chat import CHAT
from gateway.fleet.prefix_wire import decode
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from gateway.service import parse_policy
from gateway.settings import Settings
from loadtests.sim import build_engine_app
from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import REDIS_URL, RedisProcess, drop_keys, shared_client, unique_prefix
from tests.policy_builder import backend, build_policy, model, redis_state
from tests.servers import free_port, metric, serve_gateway_in_thread, serve_in_process, serve_in_thread, wait_until

TURNS = 6
SECRET = "prefix-view-test-secret"
BLOCK_TOKENS = 16


def view_policy(urls: dict[str, str], state: dict[str, Any], *, closed_loop: bool = True, **fleet: Any) -> str:
    """Two backends, prefix-affinity routing on 16-token blocks, the fleet's view on."""
    routing = {"block_tokens": BLOCK_TOKENS, "index": {"closed_loop": closed_loop}}
    return build_policy(
        "http://unused",
        backends=[backend(name, url, [CHAT_MODEL]) for name, url in urls.items()],
        models=[model(CHAT_MODEL, max_prompt_tokens=4096, max_output_tokens=32, routing=routing)],
        state=state,
        fleet={"sync_interval_s": 0.02, "lease_ttl_s": 1.0, "timeout_ms": 1000, **fleet},
        health_checks={"interval_s": 60, "timeout_s": 1},
    )


@contextmanager
def started(text: str, count: int) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        urls = []
        for _ in range(count):
            config = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0)
            urls.append(stack.enter_context(serve_gateway_in_thread(config, parse_policy(text, str(path)))).api_url)
        yield urls


@pytest.fixture(autouse=True)
def one_salt_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas share the engines' caches, hence a prefix view, only with one secret (README)."""
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)


@pytest.fixture
def backends() -> Iterator[tuple[dict[str, FakeBackend], dict[str, str]]]:
    fakes = {"a": FakeBackend(), "b": FakeBackend()}
    with serve_in_thread(fakes["a"]) as url_a, serve_in_thread(fakes["b"]) as url_b:
        yield fakes, {"a": url_a, "b": url_b}


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique_prefix()
    yield name
    drop_keys(REDIS_URL, name)


def conversation(topic: int) -> list[dict[str, str]]:
    """A first turn long enough for a dozen full blocks, distinct per topic."""
    return [{"role": "user", "content": f"topic {topic}: " + " ".join(f"w{topic}x{i}" for i in range(200))}]


def next_turn(topic: int) -> list[dict[str, str]]:
    return [*conversation(topic), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]


def ask(url: str, messages: list[dict[str, str]], key: str = KEY_ACME) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10) as sdk:
        sdk.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]


def served_by(fakes: dict[str, FakeBackend], marker: str) -> list[str]:
    return [name for name, fake in fakes.items() for r in fake.received if marker in str(r.body.get("messages"))]


def decisions(url: str, reason: str) -> float:
    return metric(url, "gateway_routing_decisions_total", reason=reason)


def test_a_next_turn_on_another_gateway_finds_its_prefix_where_the_first_went(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str
) -> None:
    fakes, urls = backends
    with started(view_policy(urls, redis_state(REDIS_URL, prefix)), 2) as (first, second):
        for topic in range(TURNS):
            ask(first, conversation(topic))
        wait_until(
            lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="received") >= TURNS,
            what="the second gateway folded the first one's decisions",
        )
        for topic in range(TURNS):
            ask(second, next_turn(topic))
        assert decisions(second, "prefix_match") == TURNS, "every next turn matched the prefix the first gateway sent"
        assert decisions(second, "no_prefix") == 0
        for topic in range(TURNS):
            first_backend, next_backend = served_by(fakes, f"topic {topic}:")
            assert first_backend == next_backend, f"topic {topic}: both turns on one backend"
        assert metric(first, "gateway_fleet_prefix_decisions_total", result="published") == TURNS
    with shared_client() as client:
        (stream,) = client.scan_iter(match=f"{prefix}fleet:prefix-view:*")
        assert 0 < client.pttl(stream) <= 600_000, "the stream expires one index TTL after the last flush"


def test_the_stream_holds_no_hash_computable_without_the_secret(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str
) -> None:
    """Whoever reads the stream and guesses acme's prompt finds neither the chain anyone computes
    from the prompt, the scope and the model, nor the gateway's own chain in the clear (whose
    hashes would seed a guessed continuation); the replicas, sharing the secret, still agree."""
    _, urls = backends
    with started(view_policy(urls, redis_state(REDIS_URL, prefix)), 2) as (first, second):
        ask(first, conversation(0))
        wait_until(
            lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="received") >= 1,
            what="the second gateway folded the decision",
        )
        ask(second, next_turn(0))
        assert decisions(second, "prefix_match") == 1, "the replicas agree on the chain"
        wait_until(
            lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="published") == 1,
            what="the second gateway published its decision",
        )
    with shared_client() as client:
        (stream,) = client.scan_iter(match=f"{prefix}fleet:prefix-view:*")
        entries = [fields for _, fields in client.xrange(stream)]
    carried = b"".join(value for fields in entries for value in fields.values())
    keyed = PrefixSecret(SECRET.encode())
    for messages in (conversation(0), next_turn(0)):
        rendered = CHAT.render({"model": CHAT_MODEL, "messages": messages})
        assert isinstance(rendered, str)
        data, size = rendered.encode(), CHARS_PER_TOKEN * BLOCK_TOKENS
        unkeyed = chain(data, size, scope_root("tenant:acme", CHAT_MODEL))
        gateways = chain(data, size, keyed.root("tenant:acme", CHAT_MODEL))
        for h in (*unkeyed, *gateways):
            assert h.to_bytes(8, "little") not in carried, f"{h:016x} is in the stream"
    opened = [tuple(d.blocks) for fields in entries for d in decode(fields, keyed)]
    assert gateways in opened, "opened with the secret: the gateway's chain of the next turn"


def test_another_tenant_never_matches_a_prefix_another_gateway_learnt(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str
) -> None:
    _, urls = backends
    with started(view_policy(urls, redis_state(REDIS_URL, prefix)), 2) as (first, second):
        ask(first, conversation(0))
        wait_until(
            lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="received") >= 1,
            what="the second gateway folded the decision",
        )
        ask(second, conversation(0), key=KEY_GLOBEX)
        assert decisions(second, "no_prefix") == 1, "globex's hashes are seeded with its own scope"
        assert decisions(second, "prefix_match") == 0
        ask(second, conversation(0))
        assert decisions(second, "prefix_match") == 1, "while acme's own prompt matches there"


def test_a_gateway_started_later_catches_up_on_the_fleets_recent_decisions(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str
) -> None:
    _, urls = backends
    text = view_policy(urls, redis_state(REDIS_URL, prefix))
    with started(text, 1) as (first,):
        for topic in range(TURNS):
            ask(first, conversation(topic))
        wait_until(
            lambda: metric(first, "gateway_fleet_prefix_decisions_total", result="published") == TURNS,
            what="the decisions published",
        )
        with started(text, 1) as (late,):
            assert metric(late, "gateway_fleet_prefix_decisions_total", result="received") == TURNS
            ask(late, conversation(3))
            assert decisions(late, "prefix_match") == 1


def test_without_the_view_each_gateway_routes_on_what_it_saw_alone(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str
) -> None:
    _, urls = backends
    with started(view_policy(urls, redis_state(REDIS_URL, prefix), prefix_view=False), 2) as (first, second):
        ask(first, conversation(0))
        ask(second, conversation(0))
        assert decisions(second, "no_prefix") == 1
        assert metric(first, "gateway_fleet_prefix_decisions_total", result="published") == 0


def test_replicas_with_different_salt_secrets_share_no_view(
    backends: tuple[dict[str, FakeBackend], dict[str, str]], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another secret salts the same tenant's blocks into other engine cache entries: nothing to share."""
    _, urls = backends
    text = view_policy(urls, redis_state(REDIS_URL, prefix))
    with started(text, 1) as (first,):
        monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", "another-secret")
        with started(text, 1) as (second,):
            ask(first, conversation(0))
            wait_until(
                lambda: metric(first, "gateway_fleet_prefix_decisions_total", result="published") == 1,
                what="the decision published",
            )
            ask(second, next_turn(0))
            assert decisions(second, "no_prefix") == 1
            assert metric(second, "gateway_fleet_prefix_decisions_total", result="received") == 0


def test_with_redis_unreachable_requests_are_answered_and_decisions_dropped(
    backends: tuple[dict[str, FakeBackend], dict[str, str]],
) -> None:
    fakes, urls = backends
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    policy = view_policy(urls, redis_state(unreachable, unique_prefix()), processes_when_unknown=1)
    with started(policy, 1) as (only,):  # alone, by the operator's word: it serves without the ledger
        for topic in range(3):
            ask(only, conversation(topic))
        ask(only, conversation(0))
        assert decisions(only, "prefix_match") == 1, "its own decisions still go into its index"
        wait_until(
            lambda: metric(only, "gateway_fleet_prefix_decisions_total", result="dropped") == 4,
            what="the flushes that failed counted",
        )
    assert sum(len(fake.received) for fake in fakes.values()) == 4


def test_after_a_redis_outage_the_view_resumes_by_itself_in_real_processes(
    backends: tuple[dict[str, FakeBackend], dict[str, str]],
) -> None:
    """Two replica processes; Redis killed while one routes (its decisions are dropped, both keep
    serving), then restarted: the next decisions reach the other replica again."""
    _, urls = backends
    server = RedisProcess()
    server.start()
    try:
        text = view_policy(urls, redis_state(server.url, unique_prefix(), timeout_ms=300))
        with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
            path = Path(folder) / "policy.yaml"
            path.write_text(text)
            argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
            argv += ["--log-level", "info"]
            first, second = (stack.enter_context(serve_in_process(argv)) for _ in range(2))
            view = lambda child, result: metric(child.admin_url, "gateway_fleet_prefix_decisions_total", result=result)  # noqa: E731
            parts = lambda child: metric(child.admin_url, "gateway_fleet_quota_requests")  # noqa: E731
            wait_until(lambda: parts(first) > 0 and parts(second) > 0, what="the capacity split between the two")
            server.kill()
            ask(first.url, conversation(0))
            wait_until(lambda: view(first, "dropped") == 1, what="the decision made during the outage dropped")
            ask(second.url, conversation(1))
            server.start()
            ask(first.url, conversation(2))
            wait_until(lambda: view(second, "received") >= 1, timeout=15, what="the view resumed")
            ask(second.url, next_turn(2))
            assert metric(second.admin_url, "gateway_routing_decisions_total", reason="prefix_match") == 1
    finally:
        server.stop()


@pytest.fixture
def forgetful_engine() -> Iterator[dict[str, str]]:
    """One simulated engine that forgets a prompt when its sequence ends, answering as llama.cpp
    does (``cached_tokens`` said even when 0): every later turn is a miss the gateways predicted."""
    app = build_engine_app(
        "llama-3.1-8b-h100", model=CHAT_MODEL, time_scale=0.01, cache_scope="running", answer_format="llamacpp"
    )
    with serve_in_thread(app) as url:
        yield {"engine": url}


def test_a_miss_seen_by_one_gateway_corrects_the_other_gateways_index(
    forgetful_engine: dict[str, str], prefix: str
) -> None:
    corrected = _after_a_miss_on_the_first_gateway(forgetful_engine, prefix, closed_loop=True)
    assert corrected == ("no_prefix", 1), "the second gateway forgot the conversation the engine evicted"


def test_with_the_loop_off_no_correction_travels(forgetful_engine: dict[str, str], prefix: str) -> None:
    corrected = _after_a_miss_on_the_first_gateway(forgetful_engine, prefix, closed_loop=False)
    assert corrected == ("prefix_match", 0), "the second gateway still believes the engine holds it"


def _after_a_miss_on_the_first_gateway(urls: dict[str, str], prefix: str, *, closed_loop: bool) -> tuple[str, float]:
    """Two conversations through the first gateway (the second learns them through the view), then
    the second conversation's next turn there: the engine held none of it. What the second gateway
    then decides for the first conversation's next turn, and the corrections it received."""
    with started(view_policy(urls, redis_state(REDIS_URL, prefix), closed_loop=closed_loop), 2) as (first, second):
        ask(first, conversation(0))
        ask(first, conversation(1))
        wait_until(
            lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="received") >= 2,
            what="the second gateway folded the first one's decisions",
        )
        ask(first, next_turn(1))
        assert metric(first, "gateway_prefix_cache_misses_total", backend="engine", model=CHAT_MODEL) == 1
        if closed_loop:
            wait_until(
                lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="correction_received") >= 1,
                what="the second gateway received the correction",
            )
        else:  # the flush that carries the miss's own decision would carry its correction too
            wait_until(
                lambda: metric(first, "gateway_fleet_prefix_decisions_total", result="published") >= 3,
                what="the first gateway flushed the miss's own decision",
            )
            wait_until(
                lambda: metric(second, "gateway_fleet_prefix_decisions_total", result="received") >= 3,
                what="the second gateway folded that flush",
            )
        ask(second, next_turn(0))
        reason = "no_prefix" if decisions(second, "no_prefix") == 1 else "prefix_match"
        return reason, metric(second, "gateway_fleet_prefix_decisions_total", result="correction_received")
