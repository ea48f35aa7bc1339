"""The cache-salt secret in prefix hashing: keyed roots, one-way trace hashes, sealed stream entries.

Replicas are two ``PrefixSecret`` objects built from the same bytes, as two processes given one
``GATEWAY_CACHE_SALT_SECRET`` build them; an outsider is whoever computes without those bytes.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import pytest
import xxhash

from gateway.dialects.chat import CHAT
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.isolation import CacheSalter, tenant_scope
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, prefix_keys, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.session_affinity import SessionAffinityRouter
from tests.routing.conftest import MODEL, chat_request, states, tenant

BLOCK = 16  # tokens: 64 bytes a block
ONE = b"one secret shared by the replicas"
OTHER = b"another secret"
PROMPT = "The quarterly figures nobody outside may read: " * 12


def keys(snapshot: PolicySnapshot, secret: PrefixSecret, who: str = "acme") -> tuple[int, ...]:
    return prefix_keys(chat_request(snapshot, PROMPT), tenant(snapshot, who), BLOCK, secret=secret).blocks


def unkeyed(snapshot: PolicySnapshot, who: str = "acme") -> tuple[int, ...]:
    """What anyone can compute from the prompt, the scope and the model: the chain from ``scope_root``."""
    rendered = CHAT.render(chat_request(snapshot, PROMPT).body)
    assert isinstance(rendered, str)
    return chain(rendered.encode(), CHARS_PER_TOKEN * BLOCK, scope_root(tenant_scope(tenant(snapshot, who)), MODEL))


def continued(hashes: Sequence[int], blocks: Sequence[bytes]) -> list[int]:
    """Each hash an outsider computes from the one before it and a guessed block."""
    return [xxhash.xxh64_intdigest(block, previous) for previous, block in zip(hashes, blocks[1:], strict=False)]


def rendered_blocks(snapshot: PolicySnapshot) -> list[bytes]:
    rendered = CHAT.render(chat_request(snapshot, PROMPT).body)
    assert isinstance(rendered, str)
    data, size = rendered.encode(), CHARS_PER_TOKEN * BLOCK
    return [data[i : i + size] for i in range(0, len(data) - size + 1, size)]


def test_replicas_sharing_the_secret_compute_the_same_chain(snapshot: PolicySnapshot) -> None:
    assert keys(snapshot, PrefixSecret(ONE)) == keys(snapshot, PrefixSecret(ONE))
    assert keys(snapshot, PrefixSecret(ONE), "shared-a") == keys(snapshot, PrefixSecret(ONE), "shared-b")


def test_the_same_prompt_and_scope_under_two_secrets_gives_unrelated_chains(snapshot: PolicySnapshot) -> None:
    one, other = keys(snapshot, PrefixSecret(ONE)), keys(snapshot, PrefixSecret(OTHER))
    assert len(one) == len(other) > 5
    assert not set(one) & set(other)


def test_no_chain_is_computable_from_the_prompt_the_scope_and_the_model_alone(snapshot: PolicySnapshot) -> None:
    assert not set(keys(snapshot, PrefixSecret(ONE))) & set(unkeyed(snapshot))


def test_the_root_is_the_hmac_of_the_secret_over_the_domain_the_scope_and_the_model() -> None:
    secret = PrefixSecret(ONE)
    expected = hmac.digest(ONE, b"prefix-keys\x00root\x00tenant:acme\x00m", "sha256")[:8]
    assert secret.root("tenant:acme", "m") == int.from_bytes(expected, "big")
    assert secret.root("tenant:acme", "m") != secret.root("tenant:acme", "other")
    assert secret.root("tenant:acme", "m") != secret.root("scope:acme", "m")


@pytest.mark.parametrize("scope", ["tenant:acme", "scope:public-bot"], ids=["a private scope", "a shared scope"])
def test_a_root_never_equals_nor_shows_in_a_cache_salt(scope: str) -> None:
    root = PrefixSecret(ONE).root(scope, MODEL)
    salt = CacheSalter(ONE).salt(scope)
    assert f"{root:016x}" not in salt
    assert root != int(salt[:16], 16)


def test_a_root_is_memoised_per_scope_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = PrefixSecret(ONE)
    first = secret.root("tenant:acme", MODEL)
    monkeypatch.setattr(hmac, "digest", lambda *_: pytest.fail("computed again"))
    assert secret.root("tenant:acme", MODEL) == first


def test_trace_hashes_keep_equality_and_none_is_a_chain_hash_or_its_continuation(snapshot: PolicySnapshot) -> None:
    secret = PrefixSecret(ONE)
    blocks = keys(snapshot, secret)
    written = secret.trace_hashes(blocks)
    assert written == PrefixSecret(ONE).trace_hashes(blocks), "a replica writes the same"
    assert written != PrefixSecret(OTHER).trace_hashes(blocks)
    assert written[:3] == secret.trace_hashes(blocks[:3]), "a shared head stays shared"
    assert continued(blocks, rendered_blocks(snapshot)) == list(blocks[1:]), "a chain in the clear continues"
    as_ints = [int(h, 16) for h in written]
    assert not set(as_ints) & set(blocks)
    assert not set(as_ints[1:]) & set(continued(as_ints, rendered_blocks(snapshot))), "no written hash seeds the next"


def test_a_sealed_entry_opens_with_the_secret_only() -> None:
    data = bytes(range(256)) * 3
    sealed = PrefixSecret(ONE).seal(data)
    assert PrefixSecret(ONE).unseal(sealed) == data, "another replica with the secret"
    assert PrefixSecret(OTHER).unseal(sealed) is None, "another secret: refused, not misread"
    assert data not in sealed
    assert PrefixSecret(ONE).seal(data) != sealed, "a fresh nonce each time"


@pytest.mark.parametrize(
    ("environ", "shared"),
    [({"GATEWAY_CACHE_SALT_SECRET": ONE.decode()}, True), ({}, False)],
    ids=["the variable gives the secret", "without it the secret is this process's own"],
)
def test_the_secret_comes_from_the_cache_salters_variable(environ: dict[str, str], shared: bool) -> None:
    first = PrefixSecret.from_env("GATEWAY_CACHE_SALT_SECRET", environ)
    second = PrefixSecret.from_env("GATEWAY_CACHE_SALT_SECRET", environ)
    assert first.shared is second.shared is shared
    assert (first.root("tenant:acme", MODEL) == second.root("tenant:acme", MODEL)) is shared
    assert (first.root("tenant:acme", MODEL) == PrefixSecret(ONE).root("tenant:acme", MODEL)) is shared


def test_session_affinity_places_sessions_by_the_secrets_roots(snapshot: PolicySnapshot) -> None:
    candidates = states(snapshot)

    def placed(secret: bytes) -> list[str]:
        router = SessionAffinityRouter(0.25, PrefixSecret(secret))
        who = tenant(snapshot, "acme")
        return [
            router.pick(chat_request(snapshot, "hi", user=f"user-{i}"), who, candidates).state.name for i in range(40)
        ]

    assert placed(ONE) == placed(ONE), "replicas sharing the secret place a session alike"
    assert placed(ONE) != placed(OTHER)


def test_the_secret_is_never_in_the_repr() -> None:
    assert ONE.decode() not in repr(PrefixSecret(ONE))
