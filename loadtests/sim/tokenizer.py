"""A deterministic word-and-punctuation tokenizer and a tiny chat template, or a model's own.

Identical text gives identical token ids in every process (xxhash, not Python's salted
`hash`), which is all prefix caching needs. Generated text is a fixed cycle of words, so a
completion is reproducible and its token count is exact: one word per token.

``HfTokenization`` (``sim --tokenizer``) is the simulator being a vLLM with a real tokenizer:
a prompt's ids are vLLM's (``gateway/request/engine_tokens.py``: the chat template, then the
Hugging Face tokenizer), so its blocks hash as vLLM's do. Generated text stays the word cycle,
and the generated ids are the tokenizer's encoding of that cycle's text, one id per generated
token: the ids of ``n`` generated tokens are then a prefix of the encoding of their text (the
whole of it when every word is one token), so a client sending the answer back in its next turn
finds the previous turn's blocks under the same hashes.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from gateway.request.chat_template import ChatTemplate

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


NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
    "template if the tokenizer does not define one."
)
"""vLLM's answer (400) to a chat request when the model has no chat template and none was given."""


class PromptError(ValueError):
    """A prompt ``HfTokenization`` will not tokenize: the request is refused (400) with this message."""


@dataclass(frozen=True, slots=True)
class HfTokenization:
    """A model's tokenizer and chat template, tokenizing prompts as vLLM does (module docstring)."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    output_ids: tuple[int, ...]  # the word cycle's text, encoded

    @classmethod
    def from_files(cls, tokenizer: str | Path, chat_template: str | Path | None = None) -> HfTokenization:
        """A ``tokenizer.json`` and a chat template (a ``.jinja`` file or a ``tokenizer_config.json``);
        raises ``Exception`` when one cannot be read."""
        from tokenizers import Tokenizer

        from gateway.request.chat_template import ChatTemplate

        loaded = Tokenizer.from_file(str(tokenizer))
        loaded.no_truncation()
        loaded.no_padding()
        template = None if chat_template is None else ChatTemplate.from_file(chat_template)
        cycle = "".join(output_text(i) for i in range(len(_WORDS)))
        ids = tuple(loaded.encode(cycle, add_special_tokens=False).ids)
        if not ids:
            raise ValueError(f"{tokenizer}: encodes the output words to no token")
        return cls(loaded, template, ids)

    def prompt_ids(self, body: Mapping[str, Any], *, chat: bool) -> list[int]:
        """The ids vLLM would compute for ``body`` (chat or completions); ``PromptError`` when vLLM
        would refuse it (a chat without a template) or the simulator cannot reproduce its ids."""
        from gateway.request.engine_tokens import engine_prompt_ids

        if chat and self.template is None:
            raise PromptError(NO_CHAT_TEMPLATE)
        ids = engine_prompt_ids(body, "chat" if chat else "completions", self.tokenizer, self.template)
        if ids is None:
            raise PromptError(
                "the simulator (--tokenizer) does not reproduce vLLM's prompt tokens for this request "
                "(continue_final_message, a request chat_template, media parts, a template that fails, ...)"
            )
        return ids

    def output_token_id(self, index: int) -> int:
        """Id of the ``index``-th generated token."""
        return self.output_ids[index % len(self.output_ids)]
