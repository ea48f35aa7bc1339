"""Engine features a body may ask for, each held to a bound that no token limit gives it.

A request's prompt and output are bounded in tokens (the model's caps, the tenant's tokens per
minute, the backend's tokens in flight), but several sampling features cost the engine work that
grows with their own size, at every decoding step and for the whole batch: the engine looks for
every stop string in the output, compares every banned word with its tail, rebuilds its bias
tables from every ``logit_bias`` entry whenever the batch changes. 20,000 stop strings in a
20-token request pass every token bound and slow every other tenant on the engine. So each such
field is bounded here, by the policy's ``limits`` (``RequestLimits``):

=============================================  ==============================================
field                                          bound
=============================================  ==============================================
``stop``, ``stop_sequences``,                  ``max_stop_sequences`` strings of
``dry_sequence_breakers``                      ``max_stop_chars`` characters
``bad_words``                                  ``max_bad_words`` words of ``max_stop_chars``
``logit_bias``                                 ``max_logit_bias`` entries: token id to -100..100
``top_logprobs``, ``prompt_logprobs``,         0 to ``max_logprobs`` (vLLM's -1, the whole
``n_probs``, completions' ``logprobs``         vocabulary, is refused); chat's ``logprobs`` a flag
``stop_token_ids``, ``allowed_token_ids``      ``max_list_items`` token ids (integers of at least 0)
``guided_choice``, ``structured_outputs``      ``max_list_items`` choices (strings)
(its ``choice``)
``response_format`` (a structural tag)         ``max_list_items`` structures and triggers
``include``                                    ``max_list_items`` strings
``metadata``                                   OpenAI's: 16 pairs, keys of 64 characters, string
                                               values of 512
``seed``                                       an integer in the signed 64-bit range
=============================================  ==============================================

A list over its bound is 400 ``too_many_items`` and a malformed entry 400 ``invalid_field``, both
naming the field (``stop``, ``stop[3]``, ``logit_bias.50256``); counts are checked by ``len``
before any entry is read (``gateway/dialects/counts.py``). One table for every API: a dialect's
``screen`` calls ``check_engine_fields`` after its allowlist, so only fields the API takes are
checked, and a field an API does not take never reaches it. Hot path: a body without any of these
fields costs one ``isdisjoint`` of its keys (about 0.15 µs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.dialects.counts import at_most
from gateway.errors import InvalidRequest
from gateway.policy.model import RequestLimits
from gateway.request.body_fields import shown

METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
"""OpenAI's bounds of ``metadata`` (16 pairs; keys up to 64 characters, values up to 512)."""
LOGIT_BIAS_RANGE = 100.0
"""A bias is between -100 and 100 (OpenAI's range; vLLM clamps to it)."""
INT64 = 2**63
"""vLLM takes a ``seed`` in the signed 64-bit range."""

FieldCheck = Callable[[Any, str, RequestLimits], None]
"""A check of one field's value (never None), named ``param`` in its errors."""


def check_engine_fields(body: dict[str, Any], limits: RequestLimits) -> None:
    """Each engine-feature field of ``body`` within its bound (module docstring); raises ``InvalidRequest``."""
    if CHECKED.isdisjoint(body):
        return
    for name, value in body.items():  # in the body's order: the first field out of bounds is named
        check = FIELD_CHECKS.get(name)
        if check is not None and value is not None:
            check(value, name, limits)


def _invalid(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {what}.", param=param)


def _listed(value: Any, param: str, limit: int, unit: str = "entries") -> list[Any]:
    if not isinstance(value, list):
        raise _invalid(param, "an array")
    at_most(value, limit, param, unit, "too_many_items")
    return value


def _short_string(value: Any, param: str, limit: int) -> None:
    if not isinstance(value, str):
        raise _invalid(param, "a string")
    if len(value) > limit:
        raise InvalidRequest(f"'{param}' has {len(value)} characters; the limit is {limit}.", param=param)


def _stop(value: Any, param: str, limits: RequestLimits) -> None:
    """A stop string or a list of them (OpenAI's ``stop`` takes both)."""
    if isinstance(value, str):
        _short_string(value, param, limits.max_stop_chars)
        return
    for i, stop in enumerate(_listed(value, param, limits.max_stop_sequences, "strings")):
        _short_string(stop, f"{param}[{i}]", limits.max_stop_chars)


def _bad_words(value: Any, param: str, limits: RequestLimits) -> None:
    for i, word in enumerate(_listed(value, param, limits.max_bad_words, "words")):
        _short_string(word, f"{param}[{i}]", limits.max_stop_chars)


def _logit_bias(value: Any, param: str, limits: RequestLimits) -> None:
    if not isinstance(value, dict):
        raise _invalid(param, "an object of token ids to biases")
    at_most(value, limits.max_logit_bias, param, "entries", "too_many_items")
    for token, bias in value.items():
        if not (token.isdecimal() and len(token) <= 10):
            raise _invalid(f"{param}.{shown(token)}", "keyed by a token id (a decimal integer)")
        if not _is_number(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise _invalid(f"{param}.{token}", "a number from -100 to 100")


def _logprobs_count(value: Any, param: str, limits: RequestLimits) -> None:
    if not _is_int(value) or not 0 <= value <= limits.max_logprobs:
        raise _invalid(param, f"an integer from 0 to {limits.max_logprobs}")


def _logprobs(value: Any, param: str, limits: RequestLimits) -> None:
    """Chat's ``logprobs`` is a flag; completions' the number of log-probabilities per token."""
    if not isinstance(value, bool):
        _logprobs_count(value, param, limits)


def _token_ids(value: Any, param: str, limits: RequestLimits) -> None:
    ids = _listed(value, param, limits.max_list_items, "token ids")
    if not all(_is_int(token) and token >= 0 for token in ids):
        raise _invalid(param, "an array of token ids (integers of at least 0)")


def _strings(value: Any, param: str, limits: RequestLimits) -> None:
    items = _listed(value, param, limits.max_list_items)
    if not all(isinstance(item, str) for item in items):
        raise _invalid(param, "an array of strings")


def _structured_outputs(value: Any, param: str, limits: RequestLimits) -> None:
    if isinstance(value, dict) and value.get("choice") is not None:
        _strings(value["choice"], f"{param}.choice", limits)


def _response_format(value: Any, param: str, limits: RequestLimits) -> None:
    """A structural tag's lists (vLLM, SGLang): ``structures`` and ``triggers``."""
    if isinstance(value, dict):
        for key in ("structures", "triggers"):
            if value.get(key) is not None:
                _listed(value[key], f"{param}.{key}", limits.max_list_items)


def _metadata(value: Any, param: str, limits: RequestLimits) -> None:
    if not isinstance(value, dict):
        raise _invalid(param, "an object of strings")
    at_most(value, METADATA_PAIRS, param, "entries", "too_many_items")
    for key, text in value.items():
        if text is None:  # Anthropic's user_id may be null
            continue
        if len(key) > METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"A key of '{param}' has {len(key)} characters; the limit is {METADATA_KEY_CHARS}.", param=param
            )
        _short_string(text, f"{param}.{key}", METADATA_VALUE_CHARS)


def _seed(value: Any, param: str, limits: RequestLimits) -> None:
    if not _is_int(value) or not -INT64 <= value < INT64:
        raise _invalid(param, "an integer (signed, 64 bits)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


FIELD_CHECKS: Mapping[str, FieldCheck] = {
    "stop": _stop,
    "stop_sequences": _stop,
    "dry_sequence_breakers": _stop,
    "bad_words": _bad_words,
    "logit_bias": _logit_bias,
    "top_logprobs": _logprobs_count,
    "prompt_logprobs": _logprobs_count,
    "n_probs": _logprobs_count,
    "logprobs": _logprobs,
    "stop_token_ids": _token_ids,
    "allowed_token_ids": _token_ids,
    "guided_choice": _strings,
    "structured_outputs": _structured_outputs,
    "response_format": _response_format,
    "include": _strings,
    "metadata": _metadata,
    "seed": _seed,
}
"""The checked fields, by name (module docstring); any API's field of one of these names."""
CHECKED = frozenset(FIELD_CHECKS)
