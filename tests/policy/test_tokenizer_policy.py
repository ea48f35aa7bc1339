"""``tokenizer: {path: ...}`` on a model, through a real gateway and the official SDK.

Two tokenizers built here: ``chars`` (one token a character: its counts run far above the
character estimate) for ``CHAT_MODEL``, and ``words`` (one token a whitespace-separated word: far
below it) for ``OTHER_MODEL``; ``PLAIN`` has none and keeps the character estimate. Every model
accepts 64 prompt tokens, so each prompt below is on the other side of the limit for the
tokenizer than for the estimate, and the gateway must follow the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from gateway.request.tokens import CharRatioEstimator
from gateway.service import load_policy
from gateway.settings import Settings
from tests.conftest import BackendServer
from tests.fake_backend import FakeBackend
from tests.policy_builder import CHAT_MODEL, KEY_ACME, OTHER_MODEL, admin_keys, backend, build_policy, model
from tests.servers import admin_url, serve_gateway_in_thread

PLAIN = "test/plain"
LIMIT = 64
OVERHEAD = 4  # the chat dialect's tokens per message
ADMIN_KEY = "admin-key-for-tokenizer-tests"
LETTERS = "a" * 100  # 100 tokens for ``chars``; about 25 by the estimate
WORDS = " ".join(["abcdefghijkl"] * 50)  # 50 tokens for ``words``; about 163 by the estimate


def save(tokenizer: Tokenizer, path: Path) -> str:
    tokenizer.save(str(path))
    return str(path)


def chars_tokenizer(path: Path) -> str:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return save(tokenizer, path)


def words_tokenizer(path: Path) -> str:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return save(tokenizer, path)


def policy(backend_url: str, **tokenizers: str) -> str:
    """Three models at ``LIMIT`` prompt tokens; ``tokenizers`` maps a model name to its file."""
    listed = [
        model(
            name, max_prompt_tokens=LIMIT, **({"tokenizer": {"path": tokenizers[name]}} if name in tokenizers else {})
        )
        for name in (CHAT_MODEL, OTHER_MODEL, PLAIN)
    ]
    return build_policy(
        backend_url,
        models=listed,
        backends=[backend("fake", backend_url, [CHAT_MODEL, OTHER_MODEL, PLAIN])],
        admin=admin_keys(ADMIN_KEY),
    )


@pytest.fixture
def gateway(backend_server: BackendServer, backend: FakeBackend, tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """A gateway with ``chars`` on ``CHAT_MODEL`` (an absolute path) and ``words`` on ``OTHER_MODEL`` (a
    path relative to the policy's folder): (API URL, policy file, backend URL)."""
    url = backend_server.url
    path = tmp_path / "policy.yaml"
    chars = chars_tokenizer(tmp_path / "chars.json")
    words_tokenizer(tmp_path / "words.json")
    path.write_text(policy(url, **{CHAT_MODEL: chars, OTHER_MODEL: "words.json"}))
    settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0, rollout_dir=str(tmp_path))
    with serve_gateway_in_thread(settings, load_policy(path)) as built:
        yield built.api_url, path, url


def ask(api_url: str, model_name: str, content: str) -> Any:
    with openai.OpenAI(base_url=f"{api_url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as client:
        return client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": content}], max_tokens=4
        )


def refusal(api_url: str, model_name: str, content: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(api_url, model_name, content)
    return refused.value


def test_the_premise_each_prompt_is_on_the_other_side_of_the_limit_for_the_estimate() -> None:
    estimate = CharRatioEstimator()
    assert estimate.count(LETTERS) + OVERHEAD <= LIMIT < len(LETTERS) + OVERHEAD
    assert len(WORDS.split()) + OVERHEAD <= LIMIT < estimate.count(WORDS) + OVERHEAD


def test_a_prompt_the_tokenizer_counts_over_the_limit_is_refused_though_the_estimate_is_under(
    gateway: tuple[str, Path, str], backend: FakeBackend
) -> None:
    api_url, _, _ = gateway
    error = refusal(api_url, CHAT_MODEL, LETTERS)
    assert error.status_code == 400
    assert error.code == "prompt_too_long"
    body = error.response.json()["error"]
    assert body["param"] == "messages"
    assert f"about {len(LETTERS) + OVERHEAD} tokens" in body["message"]
    assert ask(api_url, PLAIN, LETTERS).choices[0].message.content  # the estimate lets it through
    assert len(backend.received) == 1  # only the plain model's request reached the engine


def test_a_prompt_the_tokenizer_counts_under_the_limit_passes_though_the_estimate_is_over(
    gateway: tuple[str, Path, str], backend: FakeBackend
) -> None:
    api_url, _, _ = gateway
    answer = ask(api_url, OTHER_MODEL, WORDS)
    assert answer.choices[0].message.content
    assert refusal(api_url, PLAIN, WORDS).code == "prompt_too_long"  # the estimate refuses it
    assert len(backend.received) == 1


def reload(api_url: str) -> httpx.Response:
    return httpx.post(f"{admin_url(api_url)}/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})


def test_a_reload_naming_a_missing_tokenizer_is_refused_and_the_old_tokenizers_stay(
    gateway: tuple[str, Path, str], backend: FakeBackend
) -> None:
    api_url, path, url = gateway
    path.write_text(policy(url, **{CHAT_MODEL: "gone.json"}))
    refused = reload(api_url)
    assert refused.status_code == 422
    last_error = refused.json()["last_error"]
    assert f"models[{CHAT_MODEL}].tokenizer.path" in last_error
    assert str(path.parent / "gone.json") in last_error
    assert refusal(api_url, CHAT_MODEL, LETTERS).code == "prompt_too_long"  # still counted by ``chars``
    assert ask(api_url, OTHER_MODEL, WORDS).choices[0].message.content  # still counted by ``words``


def test_a_reload_without_the_tokenizer_goes_back_to_the_estimate(
    gateway: tuple[str, Path, str], backend: FakeBackend
) -> None:
    api_url, path, url = gateway
    path.write_text(policy(url, **{OTHER_MODEL: "words.json"}))
    assert reload(api_url).status_code == 200
    assert ask(api_url, CHAT_MODEL, LETTERS).choices[0].message.content
    assert ask(api_url, OTHER_MODEL, WORDS).choices[0].message.content
