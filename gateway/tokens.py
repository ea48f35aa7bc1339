"""Fast prompt-size estimates, used to enforce limits before a backend sees the request.

The estimate is deliberately cheap (no tokenizer on the hot path): about four characters a
token for English text with BPE vocabularies, plus a few tokens per chat message for the
template. A real tokenizer can be plugged in per model through the ``TokenEstimator``
protocol; limits are then exact instead of approximate.
"""

from __future__ import annotations

from typing import Any, Protocol

MESSAGE_OVERHEAD_TOKENS = 4


class TokenEstimator(Protocol):
    """Counts (or estimates) the tokens of a text."""

    def count(self, text: str) -> int: ...


class CharRatioEstimator:
    """``ceil(len(text) / chars_per_token)``: within ~20% for English BPE tokenizers."""

    __slots__ = ("chars_per_token",)

    def __init__(self, chars_per_token: float = 4.0) -> None:
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return -(-len(text) // int(self.chars_per_token)) if text else 0


def chat_prompt_tokens(messages: list[Any], estimator: TokenEstimator) -> int:
    """Tokens of a chat prompt: each message's text parts plus the template overhead."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS
        content = message.get("content")
        if isinstance(content, str):
            total += estimator.count(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += estimator.count(part["text"])
    return total


def prompt_input_tokens(prompt: Any, estimator: TokenEstimator) -> int:
    """Tokens of a completions ``prompt`` or embeddings ``input``: text, token ids, or lists of either."""
    if isinstance(prompt, str):
        return estimator.count(prompt)
    if isinstance(prompt, list):
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        return sum(prompt_input_tokens(item, estimator) for item in prompt)
    return 0
