"""The request trace log end to end: one JSONL line per request, readable by the load generator."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest
import xxhash

from gateway.dialects.chat import CHAT
from gateway.policy.loader import parse_policy
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.prefix_signature import session_hash
from gateway.settings import Settings
from loadtests.loadgen.records import RequestRecord
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import serve_gateway_in_thread, wait_until


def test_every_request_leaves_one_line_without_any_text(
    tmp_path: Path, backend_server: BackendServer, backend: FakeBackend
) -> None:
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    secret = "a prompt that must never reach the log"
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        url = built.api_url
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": secret}], "stream": True}
        assert httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"model": CHAT_MODEL}).status_code == 400
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 2, what="two trace lines")
    text = log.read_text()
    assert secret not in text
    assert " t0" not in text  # nor any completion text
    first, second = (RequestRecord.from_json(line) for line in log.read_bytes().splitlines())
    assert (first.status, first.tenant, first.model, first.stream) == (200, "acme", CHAT_MODEL, True)
    assert first.tokens_out == backend.tokens
    assert first.ttft_s is not None
    assert second.status == 400
    raw = orjson.loads(log.read_bytes().splitlines()[0])
    assert raw["backend"] == "fake"
    (engine_id,) = raw["engine_request_ids"]
    assert engine_id == backend.received[-1].headers["x-request-id"], "the engine's id, to find it in its logs"
    assert orjson.loads(log.read_bytes().splitlines()[1])["engine_request_ids"] == [], "no attempt, no id"
    assert raw["t_arrival"] <= raw["t_admit"] <= raw["t_dispatch"] <= raw["t_first_token"] <= raw["t_end"]


def test_a_line_carries_the_prompts_signature_the_output_cap_and_the_hashed_session(
    tmp_path: Path, backend_server: BackendServer
) -> None:
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url, models={CHAT_MODEL: {"routing": {"block_tokens": 16}}}))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    prompt = "Which rake suits wet leaves best? " * 6  # rendered, 210 bytes: three blocks of 16 tokens (64 bytes)
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        headers = {"authorization": f"Bearer {KEY_ACME}", "x-session-id": "alice-chat-1"}
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": prompt}]}
        assert httpx.post(f"{built.api_url}/v1/chat/completions", headers=headers, json=body).status_code == 200
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 1, what="one trace line")
    line = orjson.loads(log.read_bytes())
    assert (line["api"], line["max_tokens"]) == ("chat", 16)  # the model's default_max_tokens
    assert line["session"] == session_hash("acme", "alice-chat-1")
    assert "alice" not in log.read_text()
    assert line["prefix_block_tokens"] == 16  # the model's routing block size
    assert len(line["prefix_hashes"]) == 3
    assert all(len(h) == 16 for h in line["prefix_hashes"])
    assert line["prompt_tokens_est"] >= 3 * 16


def test_a_lines_hashes_cannot_be_computed_or_continued_without_the_cache_salt_secret(
    tmp_path: Path, backend_server: BackendServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever reads the log and guesses the prompt can check the guess neither from the scope and
    the model (the old unkeyed chain) nor from one written hash and the next block."""
    secret = "trace-log-test-secret"
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", secret)
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url, models={CHAT_MODEL: {"routing": {"block_tokens": 16}}}))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    body = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": "Our merger with Initech closes on 3 May. " * 5}],
    }
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        assert httpx.post(f"{built.api_url}/v1/chat/completions", headers=headers, json=body).status_code == 200
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 1, what="one trace line")
    written = orjson.loads(log.read_bytes())["prefix_hashes"]
    rendered = CHAT.render(body)
    assert isinstance(rendered, str)
    data, size = rendered.encode(), CHARS_PER_TOKEN * 16
    blocks = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
    guessed = [f"{h:016x}" for h in chain(data, size, scope_root("tenant:acme", CHAT_MODEL))]
    assert len(written) == len(guessed) == len(blocks) >= 3
    assert not set(written) & set(guessed), "not the chain of the prompt, the scope and the model"
    continued = [
        f"{xxhash.xxh64_intdigest(block, int(h, 16)):016x}" for h, block in zip(written[:-1], blocks[1:], strict=True)
    ]
    assert not set(written) & set(continued), "no written hash is the seed of the next"
    keyed = PrefixSecret(secret.encode())
    assert written == list(keyed.trace_hashes(chain(data, size, keyed.root("tenant:acme", CHAT_MODEL)))), (
        "what a holder of the secret computes"
    )
