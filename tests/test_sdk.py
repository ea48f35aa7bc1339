"""The official ``openai`` SDK, sync and async, streaming and not, against the real gateway."""

from __future__ import annotations

import openai

from tests.conftest import CHAT_MODEL, OTHER_MODEL
from tests.fake_backend import FakeBackend

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


def test_sync_chat_completion_returns_the_backends_answer(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.tokens = 3
    completion = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=8)
    assert completion.choices[0].message.content == " tok tok tok"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 3
    assert backend.received[-1].path == "/v1/chat/completions"
    assert backend.received[-1].body["messages"] == MESSAGES


def test_sync_chat_stream_yields_every_token_in_order(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.tokens = 5
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=8, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == " t0 t1 t2 t3 t4"


def test_sync_completions_returns_text_and_usage(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.tokens = 2
    completion = client.completions.create(model=CHAT_MODEL, prompt="Once upon", max_tokens=4)
    assert completion.choices[0].text == " tok tok"
    assert completion.usage is not None
    assert completion.usage.total_tokens == 9
    assert backend.received[-1].path == "/v1/completions"
    assert backend.received[-1].body["prompt"] == "Once upon"


def test_sync_embeddings_returns_vectors(client: openai.OpenAI, backend: FakeBackend) -> None:
    result = client.embeddings.create(model=OTHER_MODEL, input=["a", "b"])
    assert result.data[0].embedding == [0.1, 0.2]
    assert backend.received[-1].path == "/v1/embeddings"
    assert backend.received[-1].body["input"] == ["a", "b"]


def test_sync_models_list_names_the_policys_models(client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == [CHAT_MODEL, OTHER_MODEL]


async def test_async_chat_completion_returns_the_backends_answer(
    async_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    backend.tokens = 2
    completion = await async_client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=8)
    assert completion.choices[0].message.content == " tok tok"


async def test_async_chat_stream_yields_every_token_in_order(
    async_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    backend.tokens = 4
    stream = await async_client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=8, stream=True)
    parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(parts) == " t0 t1 t2 t3"


async def test_async_completions_stream_yields_every_token(
    async_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    backend.tokens = 3
    stream = await async_client.completions.create(model=CHAT_MODEL, prompt="Hi", max_tokens=4, stream=True)
    chunks = [chunk async for chunk in stream]
    assert backend.received[-1].path == "/v1/completions"
    assert backend.received[-1].body["stream"] is True
    assert len(chunks) == 5  # role, three tokens, finish; the usage chunk is stripped


async def test_async_embeddings_returns_vectors(async_client: openai.AsyncOpenAI, backend: FakeBackend) -> None:
    result = await async_client.embeddings.create(model=CHAT_MODEL, input="hello")
    assert len(result.data) == 1
    assert result.usage.prompt_tokens == 7


async def test_async_models_list_names_the_policys_models(async_client: openai.AsyncOpenAI) -> None:
    models = [model.id async for model in async_client.models.list()]
    assert sorted(models) == [CHAT_MODEL, OTHER_MODEL]
