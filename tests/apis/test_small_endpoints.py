"""The engines' small endpoints end to end: ``POST /tokenize``, ``/detokenize``, ``/v1/rerank`` and
``/v1/score`` through a real gateway to simulated engines, with raw HTTP (no SDK has them).

Each is authenticated, bounded, limited and counted as every API, answers in vLLM's shapes under
the model's public name, and reaches only the backends whose kind serves it: a model with none
answers 404 ``api_not_served``, a model with some is routed to those alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.sim import build_engine_app
from loadtests.sim.tokenizer import render_chat, tokenize
from tests.conftest import run_gateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread

MODEL = "ranker"
"""On two engines of kind ``sim``: every small endpoint is served."""
MIXED = "mixed"
"""On engine 0 as ``sim`` and engine 1 as ``llamacpp``: tokenizer and score go to engine 0 only."""
LLAMA = "llama-only"
"""On engine 1 as ``llamacpp`` alone: rerank is served, tokenizer and score are not."""
OPENAI = "openai-only"
"""On engine 1 as ``openai`` alone: chat is served, none of the small endpoints."""
MAX_BODY_BYTES = 4096
MAX_DOCUMENTS = 4
PATHS = ("/tokenize", "/detokenize", "/v1/rerank", "/v1/score")
DOCUMENTS = ["The fox sleeps in a den.", "Bread is baked in ovens.", "Where the dog sleeps is a mystery."]


def bodies(model_name: str) -> dict[str, dict[str, Any]]:
    """A valid body for each small endpoint."""
    return {
        "/tokenize": {"model": model_name, "prompt": "Hello, world!", "return_token_strs": True},
        "/detokenize": {"model": model_name, "tokens": [1, 2, 3]},
        "/v1/rerank": {"model": model_name, "query": "Where does the fox sleep?", "documents": DOCUMENTS, "top_n": 2},
        "/v1/score": {"model": model_name, "text_1": "Where does the fox sleep?", "text_2": DOCUMENTS},
    }


def policy(urls: tuple[str, str]) -> str:
    """Four models on two engines (one URL may stand for several backends, of several kinds),
    at most ``MAX_BODY_BYTES`` a body and ``MAX_DOCUMENTS`` documents, globex at 3 requests a
    minute, no retries (a request sent where it must not go fails the test's assertions)."""
    first, second = urls
    return build_policy(
        version="small-endpoints-1",
        models=[
            model(name, upstream_name="served", max_prompt_tokens=1024, max_output_tokens=4)
            for name in (MODEL, MIXED, LLAMA, OPENAI)
        ],
        backends=[
            backend("sim-0", first, [MODEL, MIXED], kind="sim"),
            backend("sim-1", second, [MODEL], kind="sim"),
            backend("llama", second, [MIXED, LLAMA], kind="llamacpp"),
            backend("openai", second, [OPENAI], kind="openai"),
        ],
        tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX, limits={"rpm": 3})],
        limits={"max_body_bytes": MAX_BODY_BYTES, "max_messages": MAX_DOCUMENTS},
        retry={"max_retries": 0},
    )


@dataclass
class Stack:
    """Two simulated engines and a gateway in front of them (``policy``), health checks on."""

    engines: tuple[str, str]
    url: str

    def post(self, path: str, body: dict[str, Any], key: str | None = KEY_ACME) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=20)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("rollouts")) as running:
        yield running


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for a test that injects a fault into an engine."""
    with running_stack(tmp_path) as running:
        yield running


@contextmanager
def running_stack(rollout_dir: Path) -> Iterator[Stack]:
    with ExitStack() as stack:
        engines: tuple[str, str] = tuple(  # type: ignore[assignment]
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )
        url = stack.enter_context(run_gateway(policy(engines), rollout_dir=str(rollout_dir)))
        yield Stack(engines, url)


def requests_total(url: str, api: str, status: str = "200") -> float:
    return metric(url, "gateway_requests_total", api=api, status=status)


# --- the answers ---------------------------------------------------------------------------


def test_tokenize_answers_the_engines_ids_for_a_prompt_and_for_messages(stack: Stack) -> None:
    plain = stack.post("/tokenize", bodies(MODEL)["/tokenize"])
    messages = [{"role": "user", "content": "Hi there"}]
    chat = stack.post("/tokenize", {"model": MODEL, "messages": messages})
    assert plain.status_code == chat.status_code == 200
    assert plain.json() == {
        "count": 4,
        "max_model_len": plain.json()["max_model_len"],
        "tokens": tokenize("Hello, world!"),
        "token_strs": ["Hello", ",", "world", "!"],
    }
    rendered = render_chat(messages, add_generation_prompt=True, continue_final_message=False)
    assert chat.json()["tokens"] == tokenize(rendered)
    assert chat.json()["count"] == len(tokenize(rendered))
    assert chat.json()["token_strs"] is None


def test_rerank_answers_the_documents_by_relevance_under_the_public_model_name(stack: Stack) -> None:
    answer = stack.post("/v1/rerank", bodies(MODEL)["/v1/rerank"])
    assert answer.status_code == 200
    document = answer.json()
    assert document.keys() == {"id", "model", "usage", "results"}
    assert document["model"] == MODEL  # the engine said "served"
    results = document["results"]
    assert [r["index"] for r in results] == [0, 2]  # the fox first, then where the dog sleeps; top_n 2
    assert results[0]["document"]["text"] == DOCUMENTS[0]
    assert results[0]["relevance_score"] > results[1]["relevance_score"] > 0
    assert document["usage"]["total_tokens"] == document["usage"]["prompt_tokens"] > 0


def test_score_answers_one_score_per_pair_under_any_of_vllms_field_names(stack: Stack) -> None:
    text = stack.post("/v1/score", bodies(MODEL)["/v1/score"])
    query = {"model": MODEL, "queries": "Where does the fox sleep?", "items": DOCUMENTS}
    items = stack.post("/v1/score", query)
    assert text.status_code == items.status_code == 200
    document = text.json()
    assert document.keys() == {"id", "object", "created", "model", "data", "usage"}
    assert (document["object"], document["model"]) == ("list", MODEL)
    assert [(d["index"], d["object"]) for d in document["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert document["data"][0]["score"] > document["data"][1]["score"]
    assert items.json()["data"] == document["data"]
    assert document["usage"]["prompt_tokens"] > 0


def test_every_answer_is_counted_under_its_api_and_its_usage_as_input_tokens(stack: Stack) -> None:
    before = {path: requests_total(stack.url, path.rsplit("/", 1)[1]) for path in PATHS}
    tokens_before = metric(stack.url, "gateway_tokens_total", model=MODEL, direction="input")
    answers = {path: stack.post(path, body) for path, body in bodies(MODEL).items()}
    assert {path: a.status_code for path, a in answers.items()} == dict.fromkeys(PATHS, 200)
    counted = {path: requests_total(stack.url, path.rsplit("/", 1)[1]) - before[path] for path in PATHS}
    assert counted == dict.fromkeys(PATHS, 1)
    usage = (
        answers["/tokenize"].json()["count"]
        + answers["/v1/rerank"].json()["usage"]["prompt_tokens"]
        + answers["/v1/score"].json()["usage"]["prompt_tokens"]
    )  # a detokenization reports no usage
    assert metric(stack.url, "gateway_tokens_total", model=MODEL, direction="input") - tokens_before == usage


# --- authentication, bounds and limits -----------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_request_without_a_key_is_refused_401(stack: Stack, path: str) -> None:
    answer = stack.post(path, bodies(MODEL)[path], key=None)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize("path", PATHS)
def test_a_body_over_the_byte_limit_is_refused_413(stack: Stack, path: str) -> None:
    body = {**bodies(MODEL)[path], "user": "x" * MAX_BODY_BYTES}
    answer = stack.post(path, body)
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(
            "/v1/rerank",
            {"model": MODEL, "query": "q", "documents": ["d"] * (MAX_DOCUMENTS + 1)},
            "documents",
            id="rerank documents",
        ),
        pytest.param(
            "/v1/score",
            {"model": MODEL, "text_1": "q", "text_2": ["d"] * (MAX_DOCUMENTS + 1)},
            "text_2",
            id="score items",
        ),
    ],
)
def test_more_documents_than_the_policys_limit_are_refused_400(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    answer = stack.post(path, body)
    assert answer.status_code == 400
    assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == ("too_many_messages", param)


def test_a_tenants_requests_per_minute_count_these_requests_too(stack: Stack) -> None:
    allowed = [stack.post(path, bodies(MODEL)[path], key=KEY_GLOBEX) for path in PATHS[:3]]  # globex: rpm 3
    refused = stack.post("/v1/score", bodies(MODEL)["/v1/score"], key=KEY_GLOBEX)
    assert [a.status_code for a in allowed] == [200, 200, 200]
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "tenant_rate_limited"


# --- which backends serve them -------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_name", "path"),
    [
        pytest.param(LLAMA, "/tokenize", id="tokenize on llama.cpp"),
        pytest.param(LLAMA, "/detokenize", id="detokenize on llama.cpp"),
        pytest.param(LLAMA, "/v1/score", id="score on llama.cpp"),
        pytest.param(OPENAI, "/v1/rerank", id="rerank on an OpenAI server"),
        pytest.param(OPENAI, "/tokenize", id="tokenize on an OpenAI server"),
    ],
)
def test_a_model_none_of_whose_backends_serves_the_api_answers_404(stack: Stack, model_name: str, path: str) -> None:
    answer = stack.post(path, bodies(model_name)[path])
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "api_not_served"


def test_the_same_models_serve_the_apis_their_backends_kinds_do(stack: Stack) -> None:
    rerank = stack.post("/v1/rerank", bodies(LLAMA)["/v1/rerank"])  # llama.cpp serves rerank
    chat = stack.post("/v1/chat/completions", {"model": OPENAI, "messages": [{"role": "user", "content": "Hi"}]})
    assert rerank.status_code == chat.status_code == 200
    assert rerank.json()["model"] == LLAMA


def test_a_model_of_mixed_kinds_sends_each_api_only_to_the_backends_that_serve_it(own_stack: Stack) -> None:
    serving, other = own_stack.engines  # MIXED: engine 0 as sim, engine 1 as llama.cpp
    httpx.post(f"{other}/admin/fault", json={"mode": "fail_503"}).raise_for_status()  # would fail what reaches it
    tokenized = [
        own_stack.post("/tokenize", {"model": MIXED, "prompt": f"The fox number {i} sleeps."}) for i in range(6)
    ]
    back = [own_stack.post("/detokenize", {"model": MIXED, "tokens": t.json()["tokens"]}) for t in tokenized]
    scored = [own_stack.post("/v1/score", bodies(MIXED)["/v1/score"]) for _ in range(6)]
    assert [r.status_code for r in tokenized + back + scored] == [200] * 18
    # detokenized where tokenized: the one engine that serves the tokenizer knows the pieces
    assert [r.json()["prompt"] for r in back] == [f"The fox number {i} sleeps." for i in range(6)]
    assert metric(serving, "vllm:request_success_total", finished_reason="stop") == 6  # the scores
    assert metric(other, "sim:faults_injected_total", mode="fail_503") == 0  # nothing reached it
