"""A deterministic word-and-punctuation tokenizer and a tiny chat template.

Identical text gives identical token ids in every process (xxhash, not Python's salted
`hash`), which is all prefix caching needs. Generated text is a fixed cycle of words, so a
completion is reproducible and its token count is exact: one word per token.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Mapping, Sequence

import xxhash

VOCAB_SIZE = 128_000
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_WORDS = (
    "the",
    "engine",
    "answers",
    "with",
    "simulated",
    "tokens",
    "while",
    "a",
    "batch",
    "of",
    "requests",
    "shares",
    "one",
    "step",
    "on",
    "GPU",
    "and",
    "cache",
    "blocks",
    "stay",
    "warm",
)


def tokenize(text: str) -> list[int]:
    """Token ids of `text`: one per word or punctuation mark."""
    return [xxhash.xxh32_intdigest(piece.encode()) % VOCAB_SIZE for piece in _TOKEN_RE.findall(text)]


def count_tokens(text: str) -> int:
    return len(_TOKEN_RE.findall(text))


def output_token_id(index: int) -> int:
    """Id of the `index`-th generated token (the same cycle as `output_text`)."""
    return xxhash.xxh32_intdigest(_WORDS[index % len(_WORDS)].encode()) % VOCAB_SIZE


def output_text(index: int) -> str:
    """Text of the `index`-th generated token, with its leading space."""
    return " " + _WORDS[index % len(_WORDS)]


def render_chat(
    messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool, continue_final_message: bool
) -> str:
    """Render messages in order as ``<|role|> content <|end|>``.

    With `continue_final_message` the last message is left open (no end marker, no generation
    prompt) so generation continues its text, as vLLM does for a partial assistant turn.
    """
    parts: list[str] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        parts.append(f"<|{message['role']}|> {message['content']}")
        if not (continue_final_message and i == last):
            parts.append(" <|end|> ")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|assistant|>")
    return "".join(parts)


def embed(token_ids: Sequence[int], dim: int = 256) -> list[float]:
    """A deterministic unit vector for `token_ids` (hash-based; equal inputs, equal vectors)."""
    data = array("I", token_ids).tobytes()
    raw = [xxhash.xxh64_intdigest(data, seed=d) / 2**63 - 1.0 for d in range(dim)]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]
