"""Routing on the engines' KV events, wired: a gateway process and two simulated vLLM engines, each a
process of its own that tokenizes and hashes as vLLM does (``sim --tokenizer --chat-template
--hash-seed``) and publishes its KV events; the official ``openai`` SDK as the client.

The scenario is what the estimate cannot see: the engine that served a conversation restarts
(its cache is empty), and the other engine is sent the same conversation behind the gateway's
back (with the tenant's own ``cache_salt``, as the gateway would send it). The gateway's estimate
still points at the first engine; the engines' events say the second holds the prompt, and the
next turn goes there and is answered from its cache.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.routing.isolation import CacheSalter
from loadtests.harness.tokenizers import write_tokenizer
from loadtests.sim import SIM_MODEL_NAME
from tests.policy_builder import INTERACTIVE_SLO, KEY_ACME, admin_keys, backend, model, tenant
from tests.servers import ChildServer, free_port, metric, serve_in_process, wait_until
from tests.sim.test_usage_cli import _health

ADMIN_KEY = "admin-key-for-engine-view-tests"
SOURCE = "gateway_routing_prefix_source_total"
SECRET = "engine-view-wired-secret"
TEMPLATE = Path(__file__).parents[2] / "loadtests/sim/chat_template.jinja"
HASHING = {"algorithm": "sha256_cbor", "seed": "0", "block_size": 16}
SYSTEM = "You answer questions about orders, parcels and refunds, briefly and politely. " * 6
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]


class Engine:
    """A simulated vLLM engine on fixed ports of its own (HTTP, events, replay), restartable."""

    def __init__(self, tokenizer: Path) -> None:
        self.port = free_port()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        self._tokenizer = tokenizer
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "gateway", "sim", "--profile", "fixed", "--ttft-ms", "1", "--itl-ms", "1"]
        argv += ["--port", str(self.port), "--kv-events", self.events, "--kv-events-replay", self.replay]
        argv += ["--tokenizer", str(self._tokenizer), "--chat-template", str(TEMPLATE)]
        argv += ["--hash-algo", HASHING["algorithm"], "--hash-seed", HASHING["seed"]]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        wait_until(lambda: _health(self.url) or proc.poll() is not None, 30, what="the simulator to answer")
        assert proc.poll() is None, f"the simulator exited {proc.returncode}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def backend(self, name: str) -> dict[str, Any]:
        kv_events = {"endpoint": self.events, "replay_endpoint": self.replay, "silence_s": 60, "hashing": HASHING}
        return backend(name, self.url, [SIM_MODEL_NAME], kind="sim", kv_events=kv_events)


@contextlib.contextmanager
def engines(tokenizer: Path) -> Iterator[tuple[Engine, Engine]]:
    pair = (Engine(tokenizer), Engine(tokenizer))
    try:
        for engine in pair:
            engine.start()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


def policy(pair: tuple[Engine, Engine], tokenizer: Path) -> str:
    document = {
        "version": "engine-view-1",
        "classes": {"interactive": {"rank": 0, "slo": INTERACTIVE_SLO}},
        "models": [
            {
                **model(SIM_MODEL_NAME, max_prompt_tokens=8192, max_output_tokens=32),
                "tokenizer": {"path": str(tokenizer), "chat_template": str(TEMPLATE)},
                "routing": {"strategy": "prefix_affinity", "block_tokens": 16},
            }
        ],
        "backends": [pair[0].backend("e0"), pair[1].backend("e1")],
        "tenants": [tenant("acme", KEY_ACME)],
        "admin": admin_keys(ADMIN_KEY),
        "health_checks": {"interval_s": 0.2, "timeout_s": 1.0},
    }
    return yaml.safe_dump(document)


@contextlib.contextmanager
def gateway(text: str) -> Iterator[ChildServer]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        serve = [sys.executable, "-m", "gateway", "serve", "--policy", str(path)]
        with serve_in_process([*serve, "--port", "0", "--admin-port", "0", "--log-level", "info"]) as child:
            yield child


def feeds(child: ChildServer) -> dict[str, dict[str, Any]]:
    answer = httpx.get(child.admin_url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.text
    return {b["name"]: b["kv_events"] for b in answer.json()["backends"]}


def ask(client: openai.OpenAI) -> int:
    """One turn through the gateway; the prompt tokens the engine that answered had cached."""
    answer = client.chat.completions.create(model=SIM_MODEL_NAME, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert answer.usage is not None
    details = answer.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def ask_directly(engine: Engine, salt: str) -> None:
    """The same conversation sent to ``engine`` behind the gateway's back, salted as the gateway salts it."""
    body = {"model": SIM_MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "cache_salt": salt}
    answer = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text


def test_the_next_turn_goes_where_the_engines_say_the_prompt_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    salt = CacheSalter(SECRET.encode()).salt("tenant:acme")
    tokenizer = write_tokenizer(tmp_path)
    with engines(tokenizer) as pair, gateway(policy(pair, tokenizer)) as child:
        client = openai.OpenAI(base_url=child.url + "/v1", api_key=KEY_ACME, max_retries=0)
        assert ask(client) == 0  # a cold fleet
        wait_until(
            lambda: any(f["blocks"] > 0 and f["routing"] == "events" for f in feeds(child).values()),
            15,
            what="the served engine's blocks in the gateway's index, its feed live",
        )
        served = next(name for name, f in feeds(child).items() if f["blocks"] > 0)
        first, other = (pair[0], pair[1]) if served == "e0" else (pair[1], pair[0])
        assert ask(client) > 0  # the same turn again: routed to the engine holding it (either picture agrees)

        first.stop()
        first.start()  # a fresh engine on the same ports: its first batch clears its index
        ask_directly(other, salt)
        wait_until(
            lambda: (
                feeds(child)[served]["blocks"] == 0 and feeds(child)["e1" if served == "e0" else "e0"]["blocks"] > 0
            ),
            15,
            what="the restarted engine's index emptied, the other's filled behind the gateway's back",
        )
        wait_until(lambda: all(f["routing"] == "events" for f in feeds(child).values()), 15, what="both feeds live")
        events_before = metric(child.admin_url, SOURCE, model=SIM_MODEL_NAME, source="events")

        cached = ask(client)

        assert cached > 0, "the turn went to the restarted engine, which the estimate still believed in"
        events_after = metric(child.admin_url, SOURCE, model=SIM_MODEL_NAME, source="events")
        assert events_after == events_before + 1
