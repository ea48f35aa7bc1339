"""The prefix-structure signature: a prompt's tenant-scoped block-hash chain, never its text."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.admission.build import build_request
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.policy.model import ModelPolicy, RequestLimits, Routing, Tenant
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.isolation import tenant_scope
from gateway.routing.prefix_keys import prefix_keys
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.prefix_signature import (
    DEFAULT_BLOCK_TOKENS,
    MAX_SIGNATURE_BLOCKS,
    body_signature,
    private_scope,
    request_session,
    request_signature,
    scoped_block_id,
    session_hash,
)
from gateway.types import InferenceRequest, PrefixKeys
from loadtests.loadgen.prompts import RequestFactory
from loadtests.loadgen.workload import parse_workload

MODEL = "m"
SYSTEM = "You are the assistant of a garden-tools shop; answer in two sentences at most. " * 8  # 648 bytes
BLOCK = 16  # 64 bytes a block: small prompts give several blocks
SECRET = PrefixSecret(b"signature-test-secret")


def chat(*contents: str, **fields: Any) -> dict[str, Any]:
    """A chat body: a system prompt, then user and assistant turns in turn."""
    messages = [
        {"role": "system" if i == 0 else "user" if i % 2 else "assistant", "content": c} for i, c in enumerate(contents)
    ]
    return {"model": MODEL, "messages": messages, **fields}


def request(body: dict[str, Any], api: Any = CHAT, session_id: str | None = None) -> InferenceRequest:
    built = build_request(
        api=api,
        body=body,
        raw_body=b"{}",
        request_id="r",
        arrival=0.0,
        model_policy=ModelPolicy(name=MODEL),
        limits=RequestLimits(),
        estimator=CharRatioEstimator(),
    )
    built.session_id = session_id
    return built


def tenant(name: str, cache_scope: str | None = None) -> Tenant:
    return Tenant(
        name=name, key_hashes=["sha256:" + "0" * 64], models=["*"], default_class="c", cache_scope=cache_scope
    )


def sign(body: dict[str, Any], scope: str = "tenant:acme") -> tuple[str, ...]:
    return request_signature(request(body), scope, BLOCK, secret=SECRET).hashes


def test_the_same_prompt_under_two_tenants_gives_chains_that_never_meet() -> None:
    body = chat(SYSTEM, "Which rake for wet leaves?")
    acme, globex = sign(body, "tenant:acme"), sign(body, "tenant:globex")
    assert len(acme) == len(globex) > 5
    assert not set(acme) & set(globex)


def test_two_prompts_sharing_a_system_prompt_share_the_chain_head_and_part_after_it() -> None:
    first, second = sign(chat(SYSTEM, "Which rake " * 20)), sign(chat(SYSTEM, "How long is " * 20))
    shared = sum(1 for a, b in zip(first, second, strict=False) if a == b)
    assert first[:shared] == second[:shared]
    assert len(SYSTEM) // (4 * BLOCK) - 1 <= shared < min(len(first), len(second))
    assert not set(first[shared:]) & set(second[shared:])


def test_a_conversations_next_turn_extends_the_previous_turns_chain() -> None:
    turn_1 = chat(SYSTEM, "Which rake for wet leaves? " * 4)
    turn_2 = chat(
        SYSTEM, "Which rake for wet leaves? " * 4, "A fan rake with steel tines. " * 4, "And for gravel? " * 4
    )
    one, two = sign(turn_1), sign(turn_2)
    assert two[: len(one)] == one
    assert len(two) > len(one)


def test_hashes_are_16_hex_digits_and_hold_no_text() -> None:
    signature = request_signature(request(chat(SYSTEM, "secret-word " * 30)), "tenant:acme", BLOCK, secret=SECRET)
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in signature.hashes)
    assert signature.block_tokens == BLOCK
    assert "secret" not in repr(signature)


def test_only_full_blocks_are_hashed() -> None:
    exactly_two = request_signature(
        request({"model": MODEL, "prompt": "x" * 128}, COMPLETIONS), "s", BLOCK, secret=SECRET
    )
    a_bit_more = request_signature(
        request({"model": MODEL, "prompt": "x" * 191}, COMPLETIONS), "s", BLOCK, secret=SECRET
    )
    assert len(exactly_two.hashes) == len(a_bit_more.hashes) == 2
    assert exactly_two.hashes == a_bit_more.hashes


def test_token_id_prompts_are_hashed_by_ids_block_tokens_ids_a_block() -> None:
    ids = list(range(100))
    signature = request_signature(request({"model": MODEL, "prompt": ids}, COMPLETIONS), "s", BLOCK, secret=SECRET)
    longer = request_signature(
        request({"model": MODEL, "prompt": [*ids, 7, 8]}, COMPLETIONS), "s", BLOCK, secret=SECRET
    )
    assert len(signature.hashes) == 100 // BLOCK
    assert longer.hashes[: len(signature.hashes)] == signature.hashes


def test_the_chain_is_capped_and_the_estimate_still_counts_the_whole_prompt() -> None:
    body = {"model": MODEL, "prompt": "y" * (4 * 4 * (MAX_SIGNATURE_BLOCKS + 10))}
    signature = request_signature(request(body, COMPLETIONS), "s", 4, secret=SECRET)
    assert len(signature.hashes) == MAX_SIGNATURE_BLOCKS
    assert signature.prompt_tokens_est == 4 * (MAX_SIGNATURE_BLOCKS + 10)


def test_the_routers_keys_are_reused_when_computed_for_the_same_scope_and_block_size() -> None:
    req = request(chat(SYSTEM, "Which rake?"))
    keys = prefix_keys(req, tenant("acme"), BLOCK, secret=SECRET)
    assert request_signature(req, "tenant:acme", BLOCK, secret=SECRET).hashes == SECRET.trace_hashes(keys.blocks)
    req.prefix_keys = PrefixKeys(keys.root, BLOCK, (1, 2, 3))  # what a router memoised, taken as is
    assert request_signature(req, "tenant:acme", BLOCK, secret=SECRET).hashes == SECRET.trace_hashes((1, 2, 3))
    rehashed = request_signature(req, "tenant:acme", BLOCK, secret=SECRET, reuse_keys=False)
    assert len(rehashed.hashes) == len(keys.blocks)
    other = request_signature(req, "tenant:other", BLOCK, secret=SECRET)  # another scope: hashed
    assert other.hashes[:3] != SECRET.trace_hashes((1, 2, 3))
    assert len(request_signature(req, "tenant:acme", 2 * BLOCK, secret=SECRET).hashes) == len(keys.blocks) // 2


def test_the_load_generators_body_signature_has_the_gateways_shape_but_none_of_its_keyed_hashes() -> None:
    """The load generator knows no secret: its chains are unkeyed, so they never meet a gateway's,
    which a replay never needs (it compares chains inside one trace)."""
    body = chat(SYSTEM, "Which rake for wet leaves? " * 10, max_tokens=64)
    client_side = body_signature(CHAT, body, scope=private_scope("acme"), block_tokens=BLOCK)
    gateway_side = request_signature(request(dict(body)), tenant_scope(tenant("acme")), BLOCK, secret=SECRET)
    assert len(client_side.hashes) == len(gateway_side.hashes) > 5
    assert client_side.prompt_tokens_est == gateway_side.prompt_tokens_est
    assert not set(client_side.hashes) & set(gateway_side.hashes)
    assert private_scope("acme") == tenant_scope(tenant("acme"))
    assert tenant_scope(tenant("acme", cache_scope="shared")) != private_scope("acme")


def test_a_body_the_default_limits_refuse_is_still_signed_with_its_renderings_size() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "abcd"}] * 600}  # over max_messages (512)
    signature = body_signature(CHAT, body, scope="s", block_tokens=BLOCK)
    rendered = CHAT.render(body)
    assert isinstance(rendered, str)
    assert signature.prompt_tokens_est == CharRatioEstimator().count(rendered)
    assert signature.hashes


def test_the_load_generators_default_block_size_is_the_routing_default() -> None:
    assert Routing().block_tokens == DEFAULT_BLOCK_TOKENS


@pytest.mark.parametrize(
    ("session_id", "body_fields", "expected"),
    [
        ("conv-1", {}, "conv-1"),
        (None, {"prompt_cache_key": "conv-2"}, "conv-2"),
        ("conv-1", {"prompt_cache_key": "conv-2"}, "conv-1"),
        (None, {}, None),
    ],
    ids=["the header gives the session", "else the body's prompt_cache_key", "the header wins", "else none"],
)
def test_the_session_is_the_header_else_the_prompt_cache_key(
    session_id: str | None, body_fields: dict[str, Any], expected: str | None
) -> None:
    assert request_session(request(chat("hi", **body_fields), session_id=session_id)) == expected


def test_a_session_is_hashed_per_tenant_and_never_kept_raw() -> None:
    acme = session_hash("acme", "alice@example.com")
    assert acme == session_hash("acme", "alice@example.com")
    assert acme != session_hash("globex", "alice@example.com")
    assert len(acme) == 16
    assert "alice" not in acme


def test_a_foreign_block_id_is_scoped_by_tenant_and_model() -> None:
    assert scoped_block_id("tenant:a", MODEL, "46") == scoped_block_id("tenant:a", MODEL, "46")
    assert scoped_block_id("tenant:a", MODEL, "46") != scoped_block_id("tenant:b", MODEL, "46")
    assert scoped_block_id("tenant:a", MODEL, "46") != scoped_block_id("tenant:a", "other", "46")


def test_the_load_generator_plans_each_turn_with_its_signature_and_its_conversations_session() -> None:
    workload = parse_workload(
        {
            "name": "w",
            "model": MODEL,
            "classes": {"c": {"share": 1, "priority": "c", "slo": {"ttft_ms": 500, "tpot_ms": 50}}},
            "tenants": {"acme": {"share": 1, "api_key": "k"}},
            "prompt_tokens": {"dist": "fixed", "value": 60},
            "output_tokens": {"dist": "fixed", "value": 5},
            "prefix": {"system_prompt_tokens": 100},
            "conversation": {"turns": {"dist": "fixed", "value": 2}, "active_per_tenant": 1},
        },
        source="test",
    )
    factory = RequestFactory(workload, seed=1, run_id="run", block_tokens=BLOCK)
    plans = [factory.plan(i) for i in range(4)]
    fields = [p.trace_fields for p in plans]
    assert [f["session"] for f in fields] == [session_hash("acme", "run-c1")] * 2 + [session_hash("acme", "run-c2")] * 2
    assert fields[1]["prefix_hashes"][: len(fields[0]["prefix_hashes"])] == fields[0]["prefix_hashes"]
    for planned, f in zip(plans, fields, strict=True):
        body = orjson.loads(planned.body)
        assert f == {
            "api": "chat",
            "max_tokens": 5,
            "session": f["session"],
            **body_signature(CHAT, body, scope="tenant:acme", block_tokens=BLOCK).fields(),
        }
