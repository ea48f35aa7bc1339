"""Prefix keys: tenant scoping, shared scopes, conversation chains, rendering, the cache on the request."""

from __future__ import annotations

import pytest

from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.prefix_keys import TOKENIZERS, ChainMemo, prefix_keys, render
from tests.routing.conftest import SECRET, chat_request, tenant

BLOCK = 16  # tokens: 64 bytes per block


def keys_of(snapshot: PolicySnapshot, who: str, *turns: str) -> tuple[int, ...]:
    return prefix_keys(chat_request(snapshot, *turns), tenant(snapshot, who), BLOCK, secret=SECRET).blocks


def test_the_same_prompt_under_two_tenants_gives_unrelated_keys(snapshot: PolicySnapshot) -> None:
    acme, globex = keys_of(snapshot, "acme", "Hello"), keys_of(snapshot, "globex", "Hello")
    assert len(acme) == len(globex) > 10
    assert not set(acme) & set(globex)


def test_tenants_of_one_shared_scope_get_the_same_keys(snapshot: PolicySnapshot) -> None:
    assert keys_of(snapshot, "shared-a", "Hello") == keys_of(snapshot, "shared-b", "Hello")


def test_a_shared_scope_shares_nothing_with_a_private_tenant(snapshot: PolicySnapshot) -> None:
    assert not set(keys_of(snapshot, "shared-a", "Hello")) & set(keys_of(snapshot, "acme", "Hello"))


def test_a_conversations_next_turn_extends_the_previous_chain(snapshot: PolicySnapshot) -> None:
    first = keys_of(snapshot, "acme", "What is the capital of France? " * 4)
    second = keys_of(snapshot, "acme", "What is the capital of France? " * 4, "Paris. " * 20, "And of Spain?")
    assert len(second) > len(first)
    assert second[: len(first)] == first


def memo_keys(snapshot: PolicySnapshot, memo: ChainMemo, who: str, *turns: str) -> tuple[int, ...]:
    return prefix_keys(chat_request(snapshot, *turns), tenant(snapshot, who), BLOCK, memo=memo, secret=SECRET).blocks


def test_the_memo_continues_a_conversation_with_the_keys_a_full_hash_gives(snapshot: PolicySnapshot) -> None:
    memo = ChainMemo()
    turns = ["What is the capital of France? " * 4, "Paris. " * 20, "And of Spain? " * 3, "Madrid. " * 30, "Why?"]
    for n in range(1, len(turns) + 1, 2):
        assert memo_keys(snapshot, memo, "acme", *turns[:n]) == keys_of(snapshot, "acme", *turns[:n])
    assert len(memo) == 3  # one chain per turn sent, the last one continuing the second


def test_the_memo_reuses_a_previous_turns_chain(snapshot: PolicySnapshot) -> None:
    memo = ChainMemo()
    first = memo_keys(snapshot, memo, "acme", "What is the capital of France? " * 4)
    rendered = render(CHAT, chat_request(snapshot, "What is the capital of France? " * 4).body)
    assert isinstance(rendered, str)
    # plant a wrong chain under the first turn's digest: a continued chain must start from it
    ((key, chain),) = memo._chains.items()
    memo._chains[key] = tuple(h + 1 for h in chain)
    second = memo_keys(snapshot, memo, "acme", "What is the capital of France? " * 4, "Paris. " * 20, "And?")
    assert second[: len(first)] == tuple(h + 1 for h in first)


def test_the_memo_never_serves_one_tenants_chain_to_another(snapshot: PolicySnapshot) -> None:
    memo = ChainMemo()
    acme = memo_keys(snapshot, memo, "acme", "Hello " * 40)
    globex = memo_keys(snapshot, memo, "globex", "Hello " * 40, "Hi. " * 30, "More")
    assert not set(acme) & set(globex)
    assert globex == keys_of(snapshot, "globex", "Hello " * 40, "Hi. " * 30, "More")


def test_the_memo_is_bounded_by_the_blocks_it_holds(snapshot: PolicySnapshot) -> None:
    memo = ChainMemo(max_blocks=100)
    for i in range(20):
        memo_keys(snapshot, memo, "acme", f"Question {i} " * 40)
    assert 0 < memo._held <= 100
    assert memo._held == sum(len(c) for c in memo._chains.values())


def test_a_different_system_prompt_changes_every_block(snapshot: PolicySnapshot) -> None:
    one = prefix_keys(chat_request(snapshot, "Hi"), tenant(snapshot, "acme"), BLOCK, secret=SECRET).blocks
    other = prefix_keys(
        chat_request(snapshot, "Hi", system="X" + "y" * 2000), tenant(snapshot, "acme"), BLOCK, secret=SECRET
    )
    assert not set(one) & set(other.blocks)


def test_only_full_blocks_are_keyed(snapshot: PolicySnapshot) -> None:
    request = chat_request(snapshot, "Hi")
    rendered = render(CHAT, request.body)
    assert isinstance(rendered, str)
    assert len(prefix_keys(request, tenant(snapshot, "acme"), BLOCK, secret=SECRET).blocks) == len(
        rendered.encode()
    ) // (4 * BLOCK)


def test_keys_are_computed_once_and_cached_on_the_request(snapshot: PolicySnapshot) -> None:
    request = chat_request(snapshot, "Hi")
    first = prefix_keys(request, tenant(snapshot, "acme"), BLOCK, secret=SECRET)
    assert request.prefix_keys is first
    assert prefix_keys(request, tenant(snapshot, "acme"), BLOCK, secret=SECRET) is first
    assert prefix_keys(request, tenant(snapshot, "acme"), BLOCK * 2, secret=SECRET) is not first


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]},
            "\x1esystem\x1fS\x1euser\x1fU",
            id="messages render with their roles in order",
        ),
        pytest.param(
            {"tools": [{"b": 1, "a": 2}], "messages": [{"role": "user", "content": "U"}]},
            '\x1etools\x1f[{"a":2,"b":1}]\x1euser\x1fU',
            id="tools come first with sorted keys",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]},
            "\x1euser\x1fAB",
            id="text parts are joined",
        ),
    ],
)
def test_chat_rendering_is_canonical(body: dict[str, object], expected: str) -> None:
    assert render(CHAT, body) == expected


def test_completions_text_is_rendered_as_is() -> None:
    assert render(COMPLETIONS, {"prompt": "Once upon a time"}) == "Once upon a time"


def test_completions_token_ids_are_keyed_as_ids() -> None:
    rendered = render(COMPLETIONS, {"prompt": [1, 2, 3]})
    assert not isinstance(rendered, str)
    assert list(rendered) == [1, 2, 3]


def test_a_tokenizer_keys_blocks_of_real_tokens(snapshot: PolicySnapshot) -> None:
    request = chat_request(snapshot, "Hi")
    words = TOKENIZERS["words"]
    rendered = render(CHAT, request.body)
    assert isinstance(rendered, str)
    keys = prefix_keys(request, tenant(snapshot, "acme"), BLOCK, words, secret=SECRET)
    assert len(keys.blocks) == len(words(rendered)) // BLOCK
