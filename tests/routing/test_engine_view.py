"""Routing on the engines' own word (``gateway/routing/engine_view.py``): what an engine's KV events
say it holds of a request, computed as the engine hashes it, in the request's tenant scope, only
while its feed is live; and the prefix router choosing on it over its own estimate.

The engine's blocks are stored in the index as a vLLM engine would announce them: the hashes
``EngineBlockHasher`` computes over the token ids ``engine_prompt_ids`` gives (the byte-level test
tokenizer and the simulator's ChatML template), salted with the salt the gateway sends that
backend. That those are vLLM's own hashes and ids is ``tests/kv_events/test_engine_hashes.py`` and
``tests/request/test_engine_tokens.py``; that the simulator publishes the same is
``tests/sim/test_engine_hashes.py``; the wired path (a gateway, simulated engines publishing
events, a restart) is ``tests/routing/test_engine_view_wired.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.dispatch.router import CacheReport
from gateway.kv_events.block_index import KvBlockIndexes
from gateway.kv_events.engine_hashes import EngineBlockHasher
from gateway.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from gateway.policy.model import Backend, KvEvents, KvHashing
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.chat_template import ChatTemplate
from gateway.request.engine_tokens import EngineTokenizer, engine_prompt_ids
from gateway.routing.engine_view import MISMATCH_EVIDENCE, EngineMatch, KvEngineView, engine_hashing
from gateway.routing.isolation import CacheSalter, tenant_scope
from gateway.routing.prefix_affinity import PrefixAffinityRouter
from gateway.routing.registry import build_routers
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from loadtests.harness.tokenizers import byte_level_tokenizer
from tests.fake_clock import FakeClock
from tests.routing.conftest import MODEL, SECRET, chat_request, routing_policy, states, tenant

TEMPLATE = ChatTemplate.from_file(Path(__file__).parents[2] / "loadtests/sim/chat_template.jinja")
TOKENIZER = EngineTokenizer(byte_level_tokenizer(), TEMPLATE)
HASHING = KvHashing(seed="0", block_size=16)
SALTER = CacheSalter(b"engine-view-test-secret")
ENDPOINT = "tcp://127.0.0.1:1"


def events_policy() -> PolicySnapshot:
    return parse_policy(routing_policy(), "t.yaml")


def with_feeds(snapshot: PolicySnapshot, hashed: tuple[int, ...] = (0, 1, 2)) -> list[Backend]:
    """``routing_policy``'s three sim backends, those in ``hashed`` with a KV-event feed and hashing."""
    return [
        b.model_copy(update={"kv_events": KvEvents(endpoint=ENDPOINT, hashing=HASHING)}) if i in hashed else b
        for i, b in enumerate(snapshot.policy.backends)
    ]


class Live:
    """Which backends' feeds are live (what ``KvFeeds.live`` answers)."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def __call__(self, backend: str) -> bool:
        return backend in self.names


def view(snapshot: PolicySnapshot, live: Live, indexes: KvBlockIndexes | None = None) -> KvEngineView:
    engine_view = KvEngineView(indexes or KvBlockIndexes(), live)
    engine_view.adopt(with_feeds(snapshot), {MODEL: TOKENIZER}, SALTER)
    return engine_view


def engine_chain(request: InferenceRequest, who: str, snapshot: PolicySnapshot) -> tuple[Any, ...]:
    """The hashes a vLLM engine computes for ``request`` sent by the gateway for tenant ``who``."""
    ids = engine_prompt_ids(request.body, "chat", TOKENIZER)
    assert ids is not None
    salt = SALTER.salt(tenant_scope(tenant(snapshot, who)))
    return EngineBlockHasher(engine_hashing(HASHING)).block_hashes(ids, cache_salt=salt)


def store(indexes: KvBlockIndexes, backend: str, hashes: tuple[Any, ...]) -> None:
    event = BlockStored(tuple(hashes), None, (), HASHING.block_size)
    indexes.apply(backend, EventBatch(0.0, (event,), None))


def test_an_engine_that_stored_the_prompt_holds_every_block_of_it() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    chain = engine_chain(request, "acme", snapshot)
    store(indexes, "b0", chain)
    engine_view = view(snapshot, Live("b0", "b1"), indexes)
    b0, b1, _ = states(snapshot)
    assert len(chain) > 20
    assert engine_view.held(b0, request, tenant(snapshot, "acme")) == EngineMatch(len(chain), len(chain))
    assert engine_view.held(b1, request, tenant(snapshot, "acme")) == EngineMatch(0, len(chain))


def test_a_block_the_engine_evicted_ends_the_match_there() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    chain = engine_chain(request, "acme", snapshot)
    store(indexes, "b0", chain)
    indexes.apply("b0", EventBatch(0.0, (BlockRemoved((chain[5],)),), None))
    b0 = states(snapshot)[0]
    assert view(snapshot, Live("b0"), indexes).held(b0, request, tenant(snapshot, "acme")) == EngineMatch(5, len(chain))


def test_a_restarted_engine_holds_nothing_from_its_first_batch() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    store(indexes, "b0", engine_chain(request, "acme", snapshot))
    indexes.apply("b0", EventBatch(0.0, (AllBlocksCleared(),), None))
    match = view(snapshot, Live("b0"), indexes).held(states(snapshot)[0], request, tenant(snapshot, "acme"))
    assert match is not None
    assert match.held == 0


def test_another_scope_never_matches_the_blocks_a_tenant_left() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    prompt = chat_request(snapshot, "Where is my order?")
    store(indexes, "b0", engine_chain(prompt, "acme", snapshot))
    engine_view, b0 = view(snapshot, Live("b0"), indexes), states(snapshot)[0]
    same_prompt = chat_request(snapshot, "Where is my order?")
    globex = engine_view.held(b0, same_prompt, tenant(snapshot, "globex"))
    assert globex is not None
    assert globex.held == 0
    acme = engine_view.held(b0, chat_request(snapshot, "Where is my order?"), tenant(snapshot, "acme"))
    assert acme is not None
    assert acme.held == acme.blocks


def test_tenants_of_one_shared_scope_share_the_engine_s_blocks() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    store(indexes, "b0", engine_chain(chat_request(snapshot, "Hi"), "shared-a", snapshot))
    match = view(snapshot, Live("b0"), indexes).held(
        states(snapshot)[0], chat_request(snapshot, "Hi"), tenant(snapshot, "shared-b")
    )
    assert match is not None
    assert match.held == match.blocks > 0


@pytest.mark.parametrize(
    ("hashed", "live", "model_tokenizer", "why"),
    [
        ((0,), Live(), TOKENIZER, "the feed is not live"),
        ((), Live("b0"), TOKENIZER, "the backend has no hashing"),
        ((0,), Live("b0"), None, "the model has no tokenizer"),
        ((0,), Live("b0"), EngineTokenizer(byte_level_tokenizer(), None), "a chat request and no template"),
    ],
)
def test_no_word_from_the_engine_when(
    hashed: tuple[int, ...], live: Live, model_tokenizer: EngineTokenizer | None, why: str
) -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    store(indexes, "b0", engine_chain(request, "acme", snapshot))
    engine_view = KvEngineView(indexes, live)
    engine_view.adopt(with_feeds(snapshot, hashed), {MODEL: model_tokenizer} if model_tokenizer else {}, SALTER)
    assert engine_view.held(states(snapshot)[0], request, tenant(snapshot, "acme")) is None, why


def test_a_request_is_tokenized_and_hashed_once_whatever_the_candidates() -> None:
    snapshot = events_policy()
    engine_view = view(snapshot, Live("b0", "b1", "b2"))
    request = chat_request(snapshot, "Where is my order?")
    for state in states(snapshot):
        engine_view.held(state, request, tenant(snapshot, "acme"))
    memo = request.engine_keys
    assert memo is not None
    assert set(memo) == {"ids", (HASHING, SALTER.salt("tenant:acme"))}


# The prefix router on the engines' word


def router(snapshot: PolicySnapshot, engine_view: KvEngineView) -> PrefixAffinityRouter:
    built = build_routers(snapshot, FakeClock(), SECRET, engine_view)[MODEL]
    assert isinstance(built, PrefixAffinityRouter)
    return built


def test_the_router_follows_the_engine_that_holds_the_prompt_over_its_own_estimate() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    prefix = router(snapshot, view(snapshot, Live("b0", "b1", "b2"), indexes))
    acme = tenant(snapshot, "acme")
    b0, b1, b2 = states(snapshot)
    first = chat_request(snapshot, "Where is my order?")
    decision = prefix.pick(first, acme, [b0, b1, b2])
    prefix.on_dispatch(first, acme, decision)  # the estimate now says: the chosen one holds it
    believed = decision.state
    holder = next(s for s in (b0, b1, b2) if s is not believed)  # the engines say: another holds it
    store(indexes, holder.name, engine_chain(first, "acme", snapshot))

    again = prefix.pick(chat_request(snapshot, "Where is my order?"), acme, [b0, b1, b2])
    assert again.state is holder
    assert again.reason == "prefix_match"
    assert again.engine_reported
    assert again.matched_at is None  # the closed loop corrects the estimate, not the engine's word


def test_a_backend_whose_feed_is_not_live_is_scored_on_the_estimate() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    live = Live("b0", "b1", "b2")
    prefix = router(snapshot, view(snapshot, live, indexes))
    acme, candidates = tenant(snapshot, "acme"), states(snapshot)
    first = chat_request(snapshot, "Where is my order?")
    decision = prefix.pick(first, acme, candidates)
    prefix.on_dispatch(first, acme, decision)
    # The engine's index is empty (its events are not heard: a lost feed), the estimate knows.
    live.names.discard(decision.state.name)
    again = prefix.pick(chat_request(snapshot, "Where is my order?"), acme, candidates)
    assert again.state is decision.state
    assert again.reason == "prefix_match"
    assert not again.engine_reported
    assert again.matched_at is not None


def test_after_a_restart_the_router_stops_choosing_the_cold_engine_at_its_first_batch() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    prefix = router(snapshot, view(snapshot, Live("b0", "b1", "b2"), indexes))
    acme, candidates = tenant(snapshot, "acme"), states(snapshot)
    request = chat_request(snapshot, "Where is my order?")
    decision = prefix.pick(request, acme, candidates)
    prefix.on_dispatch(request, acme, decision)
    store(indexes, decision.state.name, engine_chain(request, "acme", snapshot))
    assert prefix.pick(chat_request(snapshot, "Where is my order?"), acme, candidates).matched_blocks > 0

    indexes.apply(decision.state.name, EventBatch(0.0, (AllBlocksCleared(),), None))
    after = prefix.pick(chat_request(snapshot, "Where is my order?"), acme, candidates)
    assert after.matched_blocks == 0
    assert after.reason == "no_prefix"


# A hashing that is not the engine's


def test_a_backend_whose_index_never_matches_what_its_engine_reused_falls_back_to_the_estimate() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    engine_seed = KvHashing(seed="1", block_size=16)  # the engine's PYTHONHASHSEED is not the policy's "0"
    ids = engine_prompt_ids(request.body, "chat", TOKENIZER)
    assert ids is not None
    salt = SALTER.salt("tenant:acme")
    store(indexes, "b0", EngineBlockHasher(engine_hashing(engine_seed)).block_hashes(ids, cache_salt=salt))
    told: list[tuple[str, bool]] = []
    engine_view = KvEngineView(indexes, Live("b0"), lambda backend, bad: told.append((backend, bad)))
    engine_view.adopt(with_feeds(snapshot), {MODEL: TOKENIZER}, SALTER)
    b0, acme = states(snapshot)[0], tenant(snapshot, "acme")
    reused = CacheReport(predicted_tokens=0, cached_tokens=64, prompt_tokens=900, missed=False)
    for _ in range(MISMATCH_EVIDENCE - 1):
        match = engine_view.held(b0, chat_request(snapshot, "Where is my order?"), acme)
        assert match == EngineMatch(0, len(ids) // 16)
        engine_view.heard("b0", reused)
    assert told == []
    engine_view.heard("b0", reused)
    assert told == [("b0", True)]
    assert engine_view.held(b0, chat_request(snapshot, "Where is my order?"), acme) is None
    assert not engine_view.routes_on_events("b0")
    engine_view.adopt(with_feeds(snapshot, (1, 2)), {MODEL: TOKENIZER}, SALTER)  # a reload drops its hashing
    assert told == [("b0", True), ("b0", False)]


def test_one_match_proves_the_hashing_whatever_answers_follow() -> None:
    snapshot, indexes = events_policy(), KvBlockIndexes()
    request = chat_request(snapshot, "Where is my order?")
    store(indexes, "b0", engine_chain(request, "acme", snapshot))
    told: list[tuple[str, bool]] = []
    engine_view = KvEngineView(indexes, Live("b0"), lambda backend, bad: told.append((backend, bad)))
    engine_view.adopt(with_feeds(snapshot), {MODEL: TOKENIZER}, SALTER)
    match = engine_view.held(states(snapshot)[0], request, tenant(snapshot, "acme"))
    assert match is not None
    assert match.held > 0
    for _ in range(3 * MISMATCH_EVIDENCE):  # batches late: the engine reused what the index had not heard of yet
        engine_view.heard("b0", CacheReport(predicted_tokens=0, cached_tokens=64, prompt_tokens=900, missed=False))
    assert told == []
    assert engine_view.routes_on_events("b0")
