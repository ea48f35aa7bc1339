"""The prompt estimate: what it counts, and what each kind of text costs."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects.chat import MESSAGE_OVERHEAD_TOKENS, chat_prompt_tokens
from gateway.policy.model import MediaTokens
from gateway.request.tokens import CharRatioEstimator, prompt_input_tokens

ESTIMATE = CharRatioEstimator()
MEDIA = MediaTokens(image_url=100, input_audio=200, video_url=300, file=400)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param("", 0, id="nothing"),
        pytest.param("x" * 400, 100, id="ASCII: four characters a token"),
        pytest.param("word " * 80, 100, id="English words: four characters a token, more than their pieces"),
        pytest.param("漢" * 100, 100, id="CJK: a token a character, not a quarter"),
        pytest.param("かな" * 50, 100, id="kana: a token a character"),
        pytest.param("я" * 80, 50, id="Cyrillic: five eighths of a token a character"),
        pytest.param("é" * 80, 110, id="accented Latin: three quarters of a token more"),
        pytest.param("🙂" * 8, 32, id="emoji: four tokens each, a token a byte"),
        pytest.param("\ud800", 1, id="a lone surrogate is counted, not an error"),
    ],
)
def test_text_costs_by_script(text: str, tokens: int) -> None:
    assert ESTIMATE.count(text) == tokens


# Text built to look cheap to a character count: each is at least as many tokens as it has
# pre-tokenizer pieces in every byte-level BPE vocabulary (Llama 3, Qwen, Tekken, o200k), and
# these pieces are one token each there; the estimate charges every piece (real counts for all
# four vocabularies: loadtests/results/estimator/bound.txt).
@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        pytest.param("a " * 1000 + "a", 1001, id="single-letter words: a token a word, not half"),
        pytest.param("a\n" * 1000 + "a", 2001, id="letters on lines: newlines are not joined to words"),
        pytest.param("ab " * 1000 + "ab", 1001, id="two-letter words"),
        pytest.param("a  " * 1000 + "a", 2001, id="two spaces: the first is a piece of its own"),
        pytest.param("1 " * 1000 + "1", 2001, id="spaced digits: digits take no space"),
        pytest.param("1234567890" * 100, 1000, id="a long number: a digit a token in Qwen and Tekken"),
        pytest.param("!," * 1000, 2000, id="punctuation: a mark a token at most"),
        pytest.param("a^" * 1000, 2000, id="a rare mark before a letter is not merged with it"),
        pytest.param("a1" * 1000, 2000, id="letters and digits"),
        pytest.param("a\t" * 1000, 2000, id="tabs"),
        pytest.param("“a” " * 1000, 4000, id="curly quotes: a symbol and the letter it splits off"),
        pytest.param("你 " * 1000 + "你", 2000, id="spaced CJK: the space is a token of its own"),
    ],
)
def test_text_made_to_look_cheap_costs_at_least_its_pieces(text: str, pieces: int) -> None:
    assert ESTIMATE.count(text) >= pieces


def test_a_mixture_of_long_words_and_single_letters_costs_more_than_either_count_alone() -> None:
    # 500 words of 12 letters (3 tokens each for the vocabularies' rare words) then 1,000 single
    # letters: characters say 2,062, pieces 1,500; the long runs add 500
    text = "abcdefghijkl " * 500 + "a " * 1000
    assert ESTIMATE.count(text) >= 2000


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
            MESSAGE_OVERHEAD_TOKENS + 21,
            id="text parts, joined by a newline as chat templates join them",
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
