"""The prompt estimate: what it counts, and what each kind of text costs."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects.chat import MESSAGE_OVERHEAD_TOKENS, chat_prompt_tokens
from gateway.policy.model import MediaTokens
from gateway.tokens import CharRatioEstimator, prompt_input_tokens

ESTIMATE = CharRatioEstimator()
MEDIA = MediaTokens(image_url=100, input_audio=200, video_url=300, file=400)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param("", 0, id="nothing"),
        pytest.param("x" * 400, 100, id="ASCII: four characters a token"),
        pytest.param("漢" * 100, 100, id="CJK: a token a character, not a quarter"),
        pytest.param("かな" * 50, 100, id="kana: a token a character"),
        pytest.param("я" * 80, 50, id="Cyrillic: five eighths of a token a character"),
        pytest.param("🙂" * 8, 11, id="emoji: eleven eighths of a token each"),
        pytest.param("\ud800", 1, id="a lone surrogate is counted, not an error"),
    ],
)
def test_text_costs_by_script(text: str, tokens: int) -> None:
    assert ESTIMATE.count(text) == tokens


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


USER = {"role": "user", "content": "x" * 40}  # 10 tokens


@pytest.mark.parametrize(
    ("body", "beyond_the_user_message"),
    [
        pytest.param(chat(USER), 0, id="one message"),
        pytest.param(
            chat(USER, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}),
            MESSAGE_OVERHEAD_TOKENS + 100,
            id="an image part at the policy's charge",
        ),
        pytest.param(
            chat(USER, {"role": "user", "content": [{"type": "input_audio"}, {"type": "video_url"}, {"type": "file"}]}),
            MESSAGE_OVERHEAD_TOKENS + 900,
            id="audio, video and file parts at theirs",
        ),
        pytest.param(
            chat(USER, {"role": "user", "content": [{"type": "text", "text": "y" * 40}, "z" * 40]}),
            MESSAGE_OVERHEAD_TOKENS + 20,
            id="text parts",
        ),
        pytest.param(
            chat(
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "abcd", "arguments": "a" * 40}}],
                },
            ),
            MESSAGE_OVERHEAD_TOKENS + 4 + 1 + 10,
            id="a tool call: overhead, name and arguments",
        ),
        pytest.param(
            chat(USER, {"role": "tool", "tool_call_id": "c", "content": "r" * 40}),
            MESSAGE_OVERHEAD_TOKENS + 10,
            id="a tool result",
        ),
        pytest.param(
            chat(USER, tools=[{"type": "function", "function": {"name": "f", "description": "d" * 400}}]),
            None,
            id="tool definitions as their JSON",
        ),
        pytest.param(
            chat(USER, response_format={"type": "json_schema", "json_schema": {"schema": {"title": "t" * 400}}}),
            None,
            id="a response_format schema as its JSON",
        ),
        pytest.param(
            chat(USER, {"role": "user", "content": [{"type": "mystery", "blob": "q" * 400}]}),
            None,
            id="an unknown part as its JSON",
        ),
    ],
)
def test_everything_the_engine_will_read_counts(body: dict[str, Any], beyond_the_user_message: int | None) -> None:
    base = MESSAGE_OVERHEAD_TOKENS + 10
    counted = chat_prompt_tokens(body, ESTIMATE, MEDIA)
    if beyond_the_user_message is None:
        assert counted > base + 100  # at least the 400 characters in it
    else:
        assert counted == base + beyond_the_user_message


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        pytest.param("x" * 40, 10, id="text"),
        pytest.param([1, 2, 3], 3, id="token ids, exactly"),
        pytest.param(["x" * 40, "漢" * 5], 15, id="a batch of texts"),
        pytest.param([[1, 2], [3]], 3, id="a batch of token-id lists"),
    ],
)
def test_completion_prompts(prompt: Any, tokens: int) -> None:
    assert prompt_input_tokens(prompt, ESTIMATE) == tokens
