"""``inference-gateway sim --tokenizer``: the simulator tokenizes prompts and hashes its KV blocks as
vLLM does, so the hashes its KV events carry are the ones the gateway computes for the request
(``gateway/request/engine_tokens.py`` then ``engine_hashes.py``): a simulator in a process of its
own, asked with the official openai SDK, its events read from a ZeroMQ SUB socket. In process: the
scheduler's chain through generated tokens, int hashes, the unseeded root, the flags' checks."""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import zmq
from openai.types.chat import ChatCompletionMessageParam

from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing, HashAlgorithm
from gateway.kv_events.wire import BlockHash, BlockStored, decode_batch
from gateway.request.chat_template import ChatTemplate
from gateway.request.engine_tokens import engine_prompt_ids
from loadtests.harness.tokenizers import byte_level_tokenizer, write_tokenizer
from loadtests.sim import SIM_MODEL_NAME
from loadtests.sim.cli import _vllm_identity, register
from loadtests.sim.kvcache import UNSEEDED_WARNING, KVCache, VllmHashingSpec, block_chain
from loadtests.sim.scheduler import Scheduler
from loadtests.sim.scheduler import Sequence as Seq
from loadtests.sim.tokenizer import NO_CHAT_TEMPLATE
from tests.servers import free_port
from tests.sim.test_usage_cli import _sim

BS = 16
TEMPLATE = Path(__file__).resolve().parents[2] / "loadtests" / "sim" / "chat_template.jinja"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a careful assistant that answers in full sentences."},
    {"role": "user", "content": "Explain how a paged KV cache lets two requests share the blocks of one prefix."},
]


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    return write_tokenizer(tmp_path)


class Feed:
    """A SUB socket on a simulator's KV events, with every stored event decoded so far."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.stored: list[BlockStored] = []

    def poll(self, timeout_ms: int) -> bool:
        """Read what arrives within ``timeout_ms``; True if anything did."""
        got = False
        while self._sub.poll(timeout_ms):
            _topic, _seq, payload = self._sub.recv_multipart()
            self.stored.extend(e for e in decode_batch(payload).events if isinstance(e, BlockStored))
            got, timeout_ms = True, 0
        return got

    def wait_for(self, condition: Any, what: str, deadline_s: float = 10.0) -> None:
        end = time.monotonic() + deadline_s
        while not condition():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}")
            self.poll(50)

    def run_of(self, first: BlockHash) -> BlockStored:
        """The stored run starting at ``first``."""
        return next(e for e in self.stored if e.block_hashes[0] == first)

    def hashes(self) -> set[BlockHash]:
        return {h for e in self.stored for h in e.block_hashes}

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def _live_feed(endpoint: str, client: openai.OpenAI) -> Feed:
    """A feed that receives: stored blocks of throwaway prompts until one arrives (a SUB socket
    misses what is published before its subscription reaches the publisher)."""
    feed = Feed(endpoint)
    deadline = time.monotonic() + 15
    for k in itertools.count(1):
        client.completions.create(
            model=SIM_MODEL_NAME, prompt=list(range(10_000 * k, 10_000 * k + 2 * BS)), max_tokens=1
        )
        if feed.poll(200):
            return feed
        if time.monotonic() > deadline:
            feed.close()
            raise AssertionError("the simulator's KV events never reached the SUB socket")
    raise AssertionError("unreachable")


@pytest.fixture
def sim_with_tokenizer(tokenizer_file: Path, request: pytest.FixtureRequest) -> Iterator[tuple[openai.OpenAI, Feed]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    extra: Sequence[str] = getattr(request, "param", ())
    flags = ("--tokenizer", str(tokenizer_file), "--chat-template", str(TEMPLATE), "--kv-events", events)
    with _sim(*flags, "--hash-seed", "0", *extra) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
        feed = _live_feed(events, client)
        try:
            yield client, feed
        finally:
            feed.close()
            client.close()


def _expected(salt: str, **hashing: Any) -> tuple[list[int], tuple[BlockHash, ...]]:
    """The prompt's ids and block hashes as the gateway computes them for the chat request."""
    body = {"model": SIM_MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "cache_salt": salt}
    ids = engine_prompt_ids(body, "chat", byte_level_tokenizer(), ChatTemplate.from_file(TEMPLATE))
    assert ids is not None
    assert len(ids) > 4 * BS
    hasher = EngineBlockHasher(EngineHashing(seed="0", block_size=BS, **hashing))
    return ids, hasher.block_hashes(ids, cache_salt=salt)


def _chat(client: openai.OpenAI, salt: str) -> Any:
    answer = client.chat.completions.create(
        model=SIM_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"cache_salt": salt},
    )
    return answer.usage


@pytest.mark.parametrize(
    ("sim_with_tokenizer", "hashing"),
    [((), {"algorithm": "sha256"}), (("--hash-algo", "sha256_cbor", "--int-block-hashes"), {"int_hashes": True})],
    indirect=["sim_with_tokenizer"],
    ids=["sha256-bytes", "sha256_cbor-int"],
)
def test_the_stored_blocks_are_the_hashes_the_gateway_computes(
    sim_with_tokenizer: tuple[openai.OpenAI, Feed], hashing: dict[str, Any]
) -> None:
    client, feed = sim_with_tokenizer
    ids, chain = _expected("tenant-a", **hashing)
    use = _chat(client, "tenant-a")
    assert use.prompt_tokens == len(ids)
    feed.wait_for(lambda: chain[0] in feed.hashes(), "the prompt's blocks stored")
    run = feed.run_of(chain[0])
    assert run.block_hashes == chain  # every full block of the prompt, in order, and no other
    assert run.parent_block_hash is None
    assert run.token_ids == tuple(ids[: len(chain) * BS])
    assert all(isinstance(h, int if hashing.get("int_hashes") else bytes) for h in chain)

    _ids, other = _expected("tenant-b", **hashing)
    _chat(client, "tenant-b")
    feed.wait_for(lambda: other[0] in feed.hashes(), "the other salt's blocks stored")
    assert feed.run_of(other[0]).block_hashes == other
    assert set(other).isdisjoint(chain)

    again = _chat(client, "tenant-a")
    assert again.prompt_tokens_details.cached_tokens == (len(ids) - 1) // BS * BS


def test_a_chat_without_a_template_is_refused_as_vllm_refuses_it(tokenizer_file: Path) -> None:
    with _sim("--tokenizer", str(tokenizer_file)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=SIM_MODEL_NAME, messages=MESSAGES, max_tokens=1)
        assert refused.value.status_code == 400
        assert NO_CHAT_TEMPLATE in str(refused.value)
        text = "a completion is still tokenized by the model's tokenizer"
        answer = client.completions.create(model=SIM_MODEL_NAME, prompt=text, max_tokens=1)
        client.close()
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(byte_level_tokenizer().encode(text).ids)  # with the BOS


def _drain(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.has_work():
            return
        sched.complete(sched.schedule(), lambda seq: None)
    raise AssertionError("the scheduler did not drain")


class Stored:
    """A ``KVCacheObserver`` keeping the stored hashes as the KV events carry them."""

    def __init__(self, kv: KVCache) -> None:
        self.hashes: list[BlockHash] = []
        self._external = kv.hashing.external

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        self.hashes.append(self._external(block_hash))

    def removed(self, block_hash: BlockHash) -> None: ...


@pytest.mark.parametrize("int_hashes", [False, True])
def test_the_scheduler_continues_vllms_chain_through_generated_tokens(int_hashes: bool) -> None:
    spec = VllmHashingSpec("sha256_cbor", "0", int_hashes)
    kv = KVCache(64, BS, spec.build(BS))
    seen = Stored(kv)
    kv.observe(seen)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=4096, output_id=lambda i: 300 + i)
    seq = Seq("a", list(range(40)), 40, cache_salt="s")
    sched.add(seq)
    _drain(sched)
    assert seq.token_ids == [*range(40), *range(300, 340)]
    computed = (len(seq.token_ids) - 1) // BS  # the last sampled token is never computed, as in vLLM
    hashing = EngineHashing(algorithm=HashAlgorithm.SHA256_CBOR, seed="0", block_size=BS, int_hashes=int_hashes)
    hasher = EngineBlockHasher(hashing)
    assert seen.hashes == list(hasher.block_hashes(seq.token_ids, cache_salt="s")[:computed])


def test_an_unseeded_engine_draws_its_own_root_and_warns_as_vllm(caplog: pytest.LogCaptureFixture) -> None:
    prompt = list(range(64))
    with caplog.at_level(logging.WARNING, logger="loadtests.sim.kvcache"):
        first, second = (VllmHashingSpec("sha256_cbor").build(BS) for _ in range(2))
    assert [r.getMessage() for r in caplog.records] == [UNSEEDED_WARNING, UNSEEDED_WARNING]
    assert set(block_chain(first, prompt, 4, None)).isdisjoint(block_chain(second, prompt, 4, None))
    seeded = VllmHashingSpec("sha256_cbor", "0").build(BS)
    assert block_chain(seeded, prompt, 4, None) == list(EngineBlockHasher(EngineHashing(seed="0")).block_hashes(prompt))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["sim", "--profile", "fixed", "--port", "40001", *argv])


def test_the_flags(tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _vllm_identity(_args()) == (None, None)  # without --tokenizer: the simulator's own, as before
    for flags in (("--hash-seed", "0"), ("--int-block-hashes",), ("--chat-template", str(TEMPLATE))):
        with pytest.raises(SystemExit, match="needs --tokenizer"):
            _vllm_identity(_args(*flags))
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    tokenization, spec = _vllm_identity(_args("--tokenizer", str(tokenizer_file)))
    assert tokenization is not None
    assert tokenization.template is None
    assert spec == VllmHashingSpec("sha256", "7", False)  # vLLM's default algorithm, the environment's seed
    _tokenization, spec = _vllm_identity(
        _args(
            "--tokenizer", str(tokenizer_file), "--hash-algo", "xxhash_cbor", "--hash-seed", "1", "--int-block-hashes"
        )
    )
    assert spec == VllmHashingSpec("xxhash_cbor", "1", True)
    monkeypatch.delenv("PYTHONHASHSEED")
    assert _vllm_identity(_args("--tokenizer", str(tokenizer_file)))[1] == VllmHashingSpec("sha256", None, False)
    with pytest.raises(SystemExit, match="--tokenizer"):
        _vllm_identity(_args("--tokenizer", str(tokenizer_file.parent / "missing.json")))
