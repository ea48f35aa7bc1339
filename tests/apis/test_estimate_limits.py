"""The prompt cap and the tenant's token reservation hold against text built to look cheap.

Through a real gateway in front of a simulated engine, with raw HTTP (rerank) and the openai SDK
(chat): single-letter words are a token each in every vocabulary, but counted by characters
alone they were half a token each, and a rerank of 16,002 real tokens passed an 8,192 cap.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from loadtests.sim import build_engine_app
from loadtests.sim.tokenizer import count_tokens
from tests.conftest import run_gateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import serve_in_thread

MODEL = "ranker"
CAP = 8192
TPM = 100_000


def single_letters(words: int, seed: int) -> str:
    """``words`` one-letter words: a token each in Llama 3, Qwen, Tekken and o200k (and in the simulator)."""
    rng = random.Random(seed)
    return " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(words))


@dataclass
class Stack:
    url: str

    def post(self, path: str, body: dict[str, Any], key: str = KEY_ACME) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """One simulated engine; ``ranker`` capped at 8,192 prompt tokens; globex at ``TPM`` tokens a minute."""
    with ExitStack() as stack:
        engine = stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=1, itl_ms=1)))
        policy = build_policy(
            version="estimate-limits-1",
            models=[model(MODEL, upstream_name="served", max_prompt_tokens=CAP, max_output_tokens=4)],
            backends=[backend("sim", engine, [MODEL], kind="sim")],
            tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX, limits={"tpm": TPM})],
            retry={"max_retries": 0},
        )
        yield Stack(stack.enter_context(run_gateway(policy, health_checks=False)))


def test_the_issues_rerank_of_16002_tokens_is_refused_against_an_8192_cap(stack: Stack) -> None:
    documents = [single_letters(8000, seed) for seed in (1, 2)]
    body = {"model": MODEL, "query": "a b", "documents": documents}
    assert sum(count_tokens(d) for d in documents) + count_tokens(body["query"]) == 16_002  # the engine's count
    refused = stack.post("/v1/rerank", body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "prompt_too_long"
    assert f"model '{MODEL}' accepts at most {CAP}" in error["message"]


def test_a_rerank_of_single_letters_within_the_cap_is_answered(stack: Stack) -> None:
    documents = [single_letters(2000, seed) for seed in (3, 4)]
    answered = stack.post("/v1/rerank", {"model": MODEL, "query": "a b", "documents": documents})
    assert answered.status_code == 200, answered.text
    assert len(answered.json()["results"]) == 2


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(single_letters(9000, 5), id="single-letter words"),
        pytest.param("\n".join(single_letters(5000, 6).split()), id="letters on lines"),
        pytest.param("!," * 4500, id="punctuation"),
        pytest.param(" ".join(str(i % 10) for i in range(5000)), id="spaced digits"),
    ],
)
def test_a_chat_prompt_made_to_look_cheap_over_the_cap_is_refused(stack: Stack, content: str) -> None:
    assert len(content) / 4 < CAP  # what a character count alone saw: under the cap
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_ACME, max_retries=0)
    with client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1)
    assert refused.value.code == "prompt_too_long"


def test_the_tenants_token_reservation_counts_every_single_letter_word(stack: Stack) -> None:
    words = 4000
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_GLOBEX, max_retries=0)
    with client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": single_letters(words, 7)}], max_tokens=1
        )
    reserved = TPM - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert reserved >= words + 1  # the prompt's tokens and the output bound; characters alone said ~2,000
