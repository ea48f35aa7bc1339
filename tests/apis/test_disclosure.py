"""What a tenant can learn from errors: never a group's internal names, never which models exist.

A real gateway in front of a simulated engine, driven with raw HTTP and the official openai and
anthropic SDKs. The group ``assistant`` routes to ``assistant-v2-internal`` (smaller limits than a
client might guess, on a llama.cpp server: no ``/v1/score``) and copies to ``assistant-shadow``;
``dark`` routes to ``dark-v1-internal`` on an engine that is down. A group's targets are internal
(``gateway/policy/groups.py``): every answer names the model by the name the client sent. acme may
use the groups; ``secret`` exists, and only globex may use it: to acme it must look exactly like a
model that does not exist (OpenAI answers both with the same 404), while the operator's metrics
still tell the two apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import closed_port_url, run_gateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread

GROUP, TARGET, SHADOW = "assistant", "assistant-v2-internal", "assistant-shadow"
DARK, DARK_TARGET = "dark", "dark-v1-internal"
SECRET = "secret"
SERVED = "served-engine-name"
HIDDEN = (TARGET, SHADOW, DARK_TARGET, SERVED)
"""Names no answer to a client may contain: targets, shadows, the engines' own model name."""
PER_REQUEST_HEADERS = ("x-request-id", "date")


@dataclass
class Stack:
    url: str

    def post(self, path: str, body: dict[str, Any], key: str = KEY_ACME, **headers: str) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"authorization": f"Bearer {key}", **headers}, timeout=20)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    limits = {"upstream_name": SERVED, "max_prompt_tokens": 64, "max_output_tokens": 2048}
    with ExitStack() as stack:
        engine = stack.enter_context(serve_in_thread(build_engine_app("fixed", model=SERVED, ttft_ms=1, itl_ms=1)))
        policy = build_policy(
            version="disclosure-1",
            models=[
                model(TARGET, **limits),
                model(SHADOW, **limits),
                model(DARK_TARGET, **limits),
                model(SECRET, upstream_name=SERVED),
            ],
            backends=[
                backend("engine-a", engine, [TARGET], kind="llamacpp"),
                backend("engine-b", engine, [SHADOW, SECRET], kind="sim"),
                backend("engine-c", closed_port_url(), [DARK_TARGET], kind="sim"),
            ],
            model_groups=[
                {"name": GROUP, "targets": [{"model": TARGET}], "shadow": {"model": SHADOW, "percent": 100}},
                {"name": DARK, "targets": [{"model": DARK_TARGET}]},
            ],
            tenants=[tenant("acme", KEY_ACME, models=[GROUP, DARK]), tenant("globex", KEY_GLOBEX)],
            retry={"max_retries": 0},
        )
        rollouts = tmp_path_factory.mktemp("rollouts")
        yield Stack(stack.enter_context(run_gateway(policy, health_checks=False, rollout_dir=str(rollouts))))


def chat(model_name: str, **fields: Any) -> dict[str, Any]:
    return {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], **fields}


FAILURES = [
    pytest.param("/v1/chat/completions", chat(GROUP, max_tokens=3000), 400, id="max_tokens above the target's cap"),
    pytest.param(
        "/v1/chat/completions",
        chat(GROUP, messages=[{"role": "user", "content": "word " * 100}]),
        400,
        id="a prompt above the target's cap",
    ),
    pytest.param(
        "/v1/messages",
        {"model": GROUP, "max_tokens": 3000, "messages": [{"role": "user", "content": "Hi"}]},
        400,
        id="Messages: max_tokens above the target's cap",
    ),
    pytest.param("/v1/completions", {"model": GROUP, "prompt": "word " * 100}, 400, id="completions: a long prompt"),
    pytest.param(
        "/v1/score", {"model": GROUP, "text_1": "a", "text_2": "b"}, 404, id="an API its engines do not serve"
    ),
    pytest.param("/v1/chat/completions", chat(DARK, max_tokens=1), 502, id="a group whose engine is down"),
    pytest.param("/v1/chat/completions", chat(GROUP, n="two"), 400, id="an invalid field"),
]


@pytest.mark.parametrize(("path", "body", "status"), FAILURES)
def test_no_answer_names_a_groups_internal_models(stack: Stack, path: str, body: dict[str, Any], status: int) -> None:
    answer = stack.post(path, body)
    assert answer.status_code == status, answer.text
    shown = answer.text + "".join(f"{name}: {value}\n" for name, value in answer.headers.items())
    assert [name for name in HIDDEN if name in shown] == []


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        pytest.param("/v1/chat/completions", chat(GROUP, max_tokens=3000), "allows at most 2048", id="max_tokens"),
        pytest.param(
            "/v1/chat/completions",
            chat(GROUP, messages=[{"role": "user", "content": "word " * 100}]),
            "accepts at most 64",
            id="the prompt",
        ),
    ],
)
def test_a_limit_of_the_target_is_told_under_the_groups_name(
    stack: Stack, path: str, body: dict[str, Any], words: str
) -> None:
    error = stack.post(path, body).json()["error"]
    assert f"model '{GROUP}' {words}" in error["message"]


def comparable(answer: httpx.Response, name: str) -> tuple[int, str, list[tuple[str, str]]]:
    """Status, body with the model's name blanked, headers but the per-request ones (and the
    length, which is the body's own: a longer name, a longer body)."""
    assert int(answer.headers["content-length"]) == len(answer.content)
    skipped = (*PER_REQUEST_HEADERS, "content-length")
    headers = sorted((k, v) for k, v in answer.headers.items() if k not in skipped)
    return answer.status_code, answer.text.replace(name, "NAME"), headers


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/chat/completions", chat("{}", max_tokens=1), id="chat"),
        pytest.param("/v1/embeddings", {"model": "{}", "input": "Hi"}, id="embeddings"),
        pytest.param(
            "/v1/messages",
            {"model": "{}", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
            id="Messages",
        ),
        pytest.param("/v1/rerank", {"model": "{}", "query": "a", "documents": ["b"]}, id="rerank"),
    ],
)
@pytest.mark.parametrize("unknown", ["no-such-model", TARGET], ids=["an unknown name", "a group's target"])
def test_a_forbidden_model_answers_byte_for_byte_as_an_unknown_one(
    stack: Stack, path: str, body: dict[str, Any], unknown: str
) -> None:
    def ask(name: str) -> httpx.Response:
        return stack.post(path, {**body, "model": name})

    forbidden, missing = ask(SECRET), ask(unknown)
    assert forbidden.status_code == 404, forbidden.text
    assert comparable(forbidden, SECRET) == comparable(missing, unknown)


def test_the_openai_sdk_raises_not_found_for_a_forbidden_and_an_unknown_model(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_ACME, max_retries=0)
    raised = []
    with client:
        for name in (SECRET, "no-such-model"):
            with pytest.raises(openai.NotFoundError) as error:
                client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}])
            raised.append((error.value.code, error.value.message.replace(name, "NAME")))
    assert raised[0] == raised[1]
    assert raised[0] == (
        "model_not_found",
        "Error code: 404 - The model `NAME` does not exist or you do not have access to it.",
    )


def test_the_anthropic_sdk_raises_not_found_for_a_forbidden_and_an_unknown_model(stack: Stack) -> None:
    raised = []
    with anthropic.Anthropic(base_url=stack.url, api_key=KEY_ACME, max_retries=0) as client:
        for name in (SECRET, "no-such-model"):
            with pytest.raises(anthropic.NotFoundError) as error:
                client.messages.create(model=name, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
            raised.append(str(error.value.body).replace(name, "NAME"))
    assert raised[0] == raised[1]
    assert "does not exist or you do not have access to it" in raised[0]


def test_the_operator_still_tells_a_forbidden_model_from_an_unknown_one(stack: Stack) -> None:
    before = {
        o: metric(stack.url, "gateway_requests_total", outcome=o) for o in ("model_not_allowed", "model_not_found")
    }
    stack.post("/v1/chat/completions", chat(SECRET))
    stack.post("/v1/chat/completions", chat("no-such-model"))
    stack.post("/v1/chat/completions", chat("no-such-model"))
    after = {o: metric(stack.url, "gateway_requests_total", outcome=o) for o in before}
    assert (
        after["model_not_allowed"] - before["model_not_allowed"],
        after["model_not_found"] - before["model_not_found"],
    ) == (1, 2)


def test_the_model_list_shows_a_tenant_only_what_it_may_call(stack: Stack) -> None:
    def listed(key: str) -> set[str]:
        with openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0) as client:
            return {m.id for m in client.models.list()}

    assert listed(KEY_ACME) == {GROUP, DARK}
    assert listed(KEY_GLOBEX) == {GROUP, DARK, SECRET}


def test_the_groups_own_name_is_answered(stack: Stack, tmp_path: Path) -> None:
    answer = stack.post("/v1/chat/completions", chat(GROUP, max_tokens=2))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == GROUP
    assert [name for name in HIDDEN if name in answer.text] == []
