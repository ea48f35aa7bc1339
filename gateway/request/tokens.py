"""Fast prompt-size estimates, used to enforce limits before a backend sees the request.

The estimate is deliberately cheap (no tokenizer on the hot path) but counts everything the
engine will turn into prompt tokens, because a tenant's token limit and a model's prompt cap
are only as good as it: a part it does not see is a prompt the tenant gets for free.

* **Text** (``CharRatioEstimator``): the larger of two counts, so that text built to look cheap
  is not under-counted. *Characters*: four a token for ASCII, one per CJK character, more for
  accented Latin letters and emoji. *Pieces* (``gateway/request/text_shape.py``): the pre-tokenizer of
  a byte-level BPE vocabulary cuts text into pieces (a run of letters with the space before it,
  a digit group, a punctuation run, a newline, a run of spaces), and every piece is at least
  one token; counted one token each (each digit and each mark alone), plus one per ten letters
  of a run. Characters alone counted ``"a a a"`` at half a token a word: a rerank of 16,002
  real tokens passed an 8,192 cap.
* **Content parts** (``parts_tokens``): text parts counted; each non-text part (image, audio,
  video, file) at the policy's fixed charge (``MediaTokens``); a part of an unknown type at the
  size of its JSON (``json_tokens``, also how tool schemas are counted: templates render them
  as JSON into the prompt).
* **Text or token ids** (``prompt_input_tokens``): text, token ids (exact), or lists of either.

**An upper bound for what, and not for what.** Measured against the real vocabularies of the
models engines serve (Llama 3, Qwen 3.5, Mistral's Tekken, o200k of gpt-oss) by
``loadtests/proofs/estimator_bound.py`` (table: ``loadtests/results/estimator/bound.txt``):

* *at or above the real count* for English prose (1.1-1.2x), source code (1.0-1.5x), JSON
  (1.5x), numbers and CSV (1.0x for vocabularies with a token per digit, 2x for those grouping
  three), German, French, Spanish, Portuguese (1.03-1.3x), Russian, Greek, Chinese, Japanese,
  Korean, Hindi, Arabic (1.3-2.9x), emoji (1.1-2.4x), and for every shape made to look cheap
  (single letters, short words, digits, punctuation, newlines, tabs, runs of spaces, symbols,
  combining accents, spaced CJK, and these mixed with prose): 1.00x or more;
* *not a bound* for random strings (base64 and random letters about 0.5x, hex and UUIDs 0.96x
  for the vocabularies with a token per digit: every vocabulary spends a token per two or three
  random characters), for languages a vocabulary covers poorly (Polish 0.76x on Llama 3, rare
  scripts such as Ethiopic 0.4-0.6x), for older vocabularies on non-Latin scripts (cl100k,
  SentencePiece ones such as Llama 2 and Mistral 7B: 0.6-0.9x), nor for a string's trailing
  whitespace (one token, not charged).

A real tokenizer (the ``TokenEstimator`` protocol) makes limits exact. What each API's prompt
is made of (chat's messages, tool calls and tool definitions; completions' ``prompt``;
embeddings' ``input``) is its dialect's ``prompt_tokens`` (``gateway/dialects/``), built from
these. Cost (``loadtests/proofs/estimator_cost.py``): 1.6-3 us a KiB of long text, about 20 us for a
typical five-message chat (1.5 us when characters alone were counted).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import orjson

from gateway.policy.model import MediaTokens
from gateway.request.text_shape import leads, pieces

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
    """The larger of a character count and a piece count (module docstring).

    Characters: ``len / cpt + (utf8_bytes - len) x k``, k such that a 3-byte character (CJK,
    kana, Hangul) is one token and a 2-byte one (Cyrillic, Greek, Arabic) 5/8; an accented Latin
    letter 3/4 more, a 4-byte character (emoji) four. Pieces: ``text_shape.pieces``, plus two per
    symbol or combining mark, four per 4-byte character and one per 3-byte character after a
    space (``text_shape.leads``); never more than the UTF-8 bytes (a token is at least one).
    ``chars_per_token`` moves the character count only."""

    __slots__ = ("_per_extra_byte", "chars_per_token")

    def __init__(self, chars_per_token: float = 4.0) -> None:
        self.chars_per_token = chars_per_token
        self._per_extra_byte = (1 - 1 / chars_per_token) / 2

    def count(self, text: str) -> int:
        if not text:
            return 0
        data = text.encode("utf-8", "surrogatepass")
        n = len(text)
        if text.isascii():  # O(1) in CPython: a flag of the string object
            return max(-(-n // int(self.chars_per_token)), pieces(data))
        kinds = leads(data)
        characters = (
            n / self.chars_per_token
            + (len(data) - n - 3 * kinds.astral) * self._per_extra_byte
            + kinds.astral * (ASTRAL_TOKENS - 1 / self.chars_per_token)
            + kinds.accented * ACCENTED_EXTRA
        )
        marks = 2 * kinds.symbols + ASTRAL_TOKENS * kinds.astral + kinds.spaced_wide
        # never more than a token a byte: no byte-level vocabulary spends more
        return min(len(data), max(math.ceil(characters), pieces(data) + marks))


ASTRAL_TOKENS = 4
"""A 4-byte character (emoji, rare scripts) costs up to a token a byte: Tekken's byte fallback."""

ACCENTED_EXTRA = 0.75
"""Tokens an accented Latin letter adds: German, Spanish, French run ~3.5 characters a token."""


def json_tokens(value: Any, estimator: TokenEstimator) -> int:
    """Tokens of ``value`` rendered as JSON (tool schemas, arguments objects, unknown parts)."""
    text = json_text(value)
    return estimator.count(text) if text else 0


def json_text(value: Any) -> str:
    """``value`` as the JSON text templates render it ('' when it cannot come from a parsed body)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return ""


def parts_tokens(parts: list[Any], estimator: TokenEstimator, media: MediaTokens) -> int:
    """Tokens of a message's content parts: text counted, media at the policy's fixed charge.

    The text parts are counted as one text joined by newlines, as the engines' chat templates
    join them: one count per message rather than per part, so thousands of tiny parts cost one
    pass over their bytes, not thousands of calls (each newline counts as a token)."""
    total = 0
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        text_field = _TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if text_field is not None:
            text = part.get(text_field)
            if isinstance(text, str):
                texts.append(text)
            continue
        charge = _MEDIA_PART_CHARGE.get(kind) if isinstance(kind, str) else None
        total += getattr(media, charge) if charge is not None else json_tokens(part, estimator)
    return total + estimator.count("\n".join(texts)) if texts else total


def prompt_input_tokens(prompt: Any, estimator: TokenEstimator) -> int:
    """Tokens of a completions ``prompt`` or embeddings ``input``: text, token ids, or lists of either."""
    if isinstance(prompt, str):
        return estimator.count(prompt)
    if isinstance(prompt, list):
        if prompt and type(prompt[0]) is int:
            return len(prompt)  # token ids (the validation checked every item is an int)
        return sum(prompt_input_tokens(item, estimator) for item in prompt)
    return 0
