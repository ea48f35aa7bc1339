"""Fast prompt-size estimates, used to enforce limits before a backend sees the request.

The estimate is deliberately cheap (no tokenizer on the hot path) but counts everything the
engine will turn into prompt tokens, because a tenant's token limit and a model's prompt cap
are only as good as it: a part it does not see is a prompt the tenant gets for free.

* **Text**: about four characters a token for ASCII (English BPE vocabularies), and about one
  token per CJK character: ``len / 4 + (utf8_bytes - len) x 3/8``, so a 3-byte character
  (CJK, kana, Hangul) counts 1, a 2-byte one (accented Latin, Cyrillic, Greek) 5/8 and a
  4-byte one (emoji) 11/8. Counting characters alone under-counted CJK text by 4x.
* **Content parts** (``parts_tokens``): text parts counted; each non-text part (image, audio,
  video, file) at the policy's fixed charge (``MediaTokens``); a part of an unknown type at the
  size of its JSON (``json_tokens``, also how tool schemas are counted: templates render them
  as JSON into the prompt).
* **Text or token ids** (``prompt_input_tokens``): text, token ids (exact), or lists of either.

What each API's prompt is made of (chat's messages, tool calls and tool definitions;
completions' ``prompt``; embeddings' ``input``) is its dialect's ``prompt_tokens``
(``gateway/dialects/``), built from these.

A real tokenizer can be plugged in per model through the ``TokenEstimator`` protocol; limits
are then exact instead of approximate. Cost: ``loadtests/estimator_cost.py``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import orjson

from gateway.policy.model import MediaTokens

# Content part types the engines accept, by the charge (``MediaTokens`` field) they cost.
_MEDIA_PART_CHARGE = {
    "image_url": "image_url",
    "image_embeds": "image_url",
    "input_image": "image_url",
    "input_audio": "input_audio",
    "audio_url": "input_audio",
    "video_url": "video_url",
    "file": "file",
}
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "refusal": "refusal"}


class TokenEstimator(Protocol):
    """Counts (or estimates) the tokens of a text."""

    def count(self, text: str) -> int: ...


class CharRatioEstimator:
    """``ceil(len / cpt + (utf8_bytes - len) x k)``, k such that a 3-byte character is one token.

    Within ~20% for English BPE tokenizers; about right for CJK; over-counts Cyrillic and
    Greek by up to 2x (safe: a limit errs towards refusing, never towards a free prompt)."""

    __slots__ = ("_per_extra_byte", "chars_per_token")

    def __init__(self, chars_per_token: float = 4.0) -> None:
        self.chars_per_token = chars_per_token
        self._per_extra_byte = (1 - 1 / chars_per_token) / 2

    def count(self, text: str) -> int:
        if not text:
            return 0
        n = len(text)
        if text.isascii():  # O(1) in CPython: a flag of the string object
            return -(-n // int(self.chars_per_token))
        extra = len(text.encode("utf-8", "surrogatepass")) - n
        return math.ceil(n / self.chars_per_token + extra * self._per_extra_byte)


def json_tokens(value: Any, estimator: TokenEstimator) -> int:
    """Tokens of ``value`` rendered as JSON (tool schemas, arguments objects, unknown parts)."""
    try:
        return estimator.count(orjson.dumps(value).decode())
    except TypeError:  # not JSON-serialisable: cannot come from a parsed body
        return 0


def parts_tokens(parts: list[Any], estimator: TokenEstimator, media: MediaTokens) -> int:
    """Tokens of a message's content parts: text counted, media at the policy's fixed charge."""
    total = 0
    for part in parts:
        if isinstance(part, str):
            total += estimator.count(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        text_field = _TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if text_field is not None:
            text = part.get(text_field)
            total += estimator.count(text) if isinstance(text, str) else 0
            continue
        charge = _MEDIA_PART_CHARGE.get(kind) if isinstance(kind, str) else None
        total += getattr(media, charge) if charge is not None else json_tokens(part, estimator)
    return total


def prompt_input_tokens(prompt: Any, estimator: TokenEstimator) -> int:
    """Tokens of a completions ``prompt`` or embeddings ``input``: text, token ids, or lists of either."""
    if isinstance(prompt, str):
        return estimator.count(prompt)
    if isinstance(prompt, list):
        if prompt and type(prompt[0]) is int:
            return len(prompt)  # token ids (the validation checked every item is an int)
        return sum(prompt_input_tokens(item, estimator) for item in prompt)
    return 0
