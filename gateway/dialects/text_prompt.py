"""A prompt of text or token ids: completions' ``prompt`` and embeddings' ``input``.

Accepted shapes: a string, a non-empty list of strings, of token ids, or of non-empty
token-id lists. Its size is known before it is read when it is a list (each item is at least a
token: an empty string is refused all the same), so a list longer than the model's prompt cap is
refused before any item is read. The estimate: text by the estimator, token ids exactly
(``tokens.prompt_input_tokens``). The rendering for prefix keys: the text as is, token ids as
their 4-byte array, anything else as JSON.
"""

from __future__ import annotations

from array import array
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.policy.model import ModelPolicy
from gateway.request.field_limits import prompt_too_long
from gateway.request.tokens import TokenEstimator, prompt_input_tokens

_TOKEN_TYPES = {int}


def text_prompt_tokens(field: str, body: dict[str, Any], model: ModelPolicy, estimator: TokenEstimator) -> int:
    """Check ``body[field]`` is text or token ids (list lengths first), then estimate it."""
    value = body.get(field)
    if isinstance(value, list):
        # Each item is at least a token (an empty string is refused all the same), and the
        # lengths are known without reading an item: a long list is refused before it is read.
        items = sum(map(len, value)) if value and set(map(type, value)) == {list} else len(value)
        if items > model.max_prompt_tokens:
            raise prompt_too_long(field, model, f"at least {items} tokens")
    if not is_text_or_tokens(value):
        raise InvalidRequest(f"'{field}' is required: a string, a list of strings, or token ids.", param=field)
    return prompt_input_tokens(value, estimator)


def is_text_or_tokens(value: Any) -> bool:
    """A string, a non-empty list of strings, of token ids, or of non-empty token-id lists.

    Item types are checked with ``set(map(type, ...))``: a C loop, no Python call per item."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    types = set(map(type, value))
    if types == {str} or types == _TOKEN_TYPES:
        return True
    return types == {list} and all(item and set(map(type, item)) == _TOKEN_TYPES for item in value)


def render_text_prompt(value: Any) -> str | array[int]:
    """The canonical prompt: the text as is; token ids as an array; anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and type(value[0]) is int:
        try:
            return array("I", value)  # validation checked the ids; array() re-checks them in C
        except (TypeError, OverflowError):
            pass
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
