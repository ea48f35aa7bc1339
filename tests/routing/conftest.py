"""Helpers for the routing tests: a policy with three backends, tenants, requests, states."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.backends import BackendPool, BackendState
from gateway.dialects.chat import CHAT
from gateway.keys import hash_api_key
from gateway.policy.loader import parse_policy
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.tokens import CharRatioEstimator
from gateway.types import InferenceRequest
from gateway.validation import build_request

MODEL = "m"
SYSTEM = "You are the assistant of a large company. " * 40  # ~1,700 characters: several blocks


def policy_text(routing: str = "", backends: int = 3, extra: str = "") -> str:
    listed = "\n".join(
        f'  - {{name: b{i}, url: "http://127.0.0.1:{1 + i}", kind: sim, models: [{MODEL}], '
        f"capacity: {{max_concurrent: 100, kv_cache_tokens: 6400}}}}"
        for i in range(backends)
    )
    return f"""
version: t
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - name: {MODEL}
    max_prompt_tokens: 100000
    {routing}
backends:
{listed}
cache_scopes:
  public-bot: {{description: the public help bot's system prompt}}
tenants:
  - {{name: acme, key_hashes: ["{hash_api_key("key-acme")}"], models: ["*"], default_class: interactive}}
  - {{name: globex, key_hashes: ["{hash_api_key("key-globex")}"], models: ["*"], default_class: interactive}}
  - {{name: shared-a, key_hashes: ["{hash_api_key("key-sa")}"], models: ["*"], default_class: interactive,
      cache_scope: public-bot}}
  - {{name: shared-b, key_hashes: ["{hash_api_key("key-sb")}"], models: ["*"], default_class: interactive,
      cache_scope: public-bot}}
{extra}
"""


@pytest.fixture
def snapshot() -> PolicySnapshot:
    return parse_policy(policy_text(), "t.yaml")


def tenant(snapshot: PolicySnapshot, name: str) -> Tenant:
    return next(t for t in snapshot.policy.tenants if t.name == name)


def chat_request(
    snapshot: PolicySnapshot, *turns: str, system: str = SYSTEM, max_tokens: int = 16, **fields: Any
) -> InferenceRequest:
    """A chat request: the system prompt, then ``turns`` alternating user and assistant."""
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **fields}
    return build_request(
        api=CHAT,
        body=body,
        raw_body=b"",
        request_id="r",
        arrival=0.0,
        model_policy=snapshot.models[MODEL],
        limits=snapshot.policy.limits,
        estimator=CharRatioEstimator(),
    )


def states(snapshot: PolicySnapshot) -> list[BackendState]:
    return list(BackendPool(snapshot).for_model(MODEL))


def load(state: BackendState, requests: int, tokens_each: int = 100) -> BackendState:
    for _ in range(requests):
        state.reserve(0, tokens_each)
    return state
