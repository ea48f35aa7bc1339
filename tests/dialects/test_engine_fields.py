"""The bounds of the engine features no token limit bounds (``gateway/dialects/engine_fields.py``).

Table-driven, at each bound: a value at the limit passes, one over is refused with the code and
the field it must name. Small limits, so that each row reads at a glance; then the defaults, and
the wiring: every dialect that takes one of these fields checks it in its ``screen``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.dialects.allowlists import NO_GRANTS
from gateway.dialects.engine_fields import FIELD_CHECKS, check_engine_fields
from gateway.dialects.registry import DIALECTS
from gateway.errors import InvalidRequest
from gateway.policy.model import RequestLimits
from tests.dialects.samples import SAMPLES

LIMITS = RequestLimits(
    max_stop_sequences=3, max_stop_chars=5, max_bad_words=2, max_logit_bias=2, max_logprobs=3, max_list_items=4
)


def strings(n: int, chars: int = 2) -> list[str]:
    return [f"{i:0{chars}d}"[-chars:] for i in range(n)]


PASSES = [
    pytest.param({"stop": strings(3)}, id="as many stop strings as the limit"),
    pytest.param({"stop": "abcde"}, id="one stop string as long as the limit"),
    pytest.param({"stop": ["abcde"]}, id="a listed stop string as long as the limit"),
    pytest.param({"stop_sequences": strings(3)}, id="as many Messages stop sequences as the limit"),
    pytest.param({"dry_sequence_breakers": strings(3)}, id="as many DRY sequence breakers as the limit"),
    pytest.param({"bad_words": ["abcde", "x"]}, id="as many bad words as the limit, one as long as the limit"),
    pytest.param({"logit_bias": {"1": -100, "50256": 100}}, id="as many logit biases as the limit, at -100 and 100"),
    pytest.param({"logit_bias": {"7": 0.5}}, id="a fractional bias"),
    pytest.param({"top_logprobs": 3, "prompt_logprobs": 0, "n_probs": 3}, id="logprobs counts within 0 to the limit"),
    pytest.param({"logprobs": True}, id="chat's logprobs flag"),
    pytest.param({"logprobs": 3}, id="completions' logprobs at the limit"),
    pytest.param({"stop_token_ids": [0, 1, 2, 3], "allowed_token_ids": [9, 8, 7, 6]}, id="token-id lists at the limit"),
    pytest.param({"guided_choice": strings(4)}, id="as many guided choices as the limit"),
    pytest.param({"structured_outputs": {"choice": strings(4)}}, id="as many structured-output choices as the limit"),
    pytest.param({"structured_outputs": {"regex": "[a-z]+"}}, id="structured outputs without choices"),
    pytest.param(
        {"response_format": {"type": "structural_tag", "structures": [{}] * 4, "triggers": ["<f"] * 4}},
        id="a structural tag's lists at the limit",
    ),
    pytest.param({"response_format": {"type": "json_object"}}, id="a response format without lists"),
    pytest.param({"include": strings(4)}, id="as many include entries as the limit"),
    pytest.param({"metadata": {f"k{i}": "v" for i in range(16)}}, id="16 metadata pairs"),
    pytest.param({"metadata": {"k" * 64: "v" * 512}}, id="a metadata key of 64 characters and a value of 512"),
    pytest.param({"metadata": {"user_id": None}}, id="Anthropic's null user_id"),
    pytest.param({"seed": 2**63 - 1}, id="the largest seed"),
    pytest.param({"seed": -(2**63)}, id="the smallest seed"),
    pytest.param({"stop": None, "logit_bias": None, "seed": None}, id="fields given as null"),
    pytest.param({"model": "m", "messages": []}, id="a body without any of them"),
]


@pytest.mark.parametrize("body", PASSES)
def test_a_feature_within_its_bound_passes(body: dict[str, Any]) -> None:
    check_engine_fields(copy.deepcopy(body), LIMITS)


REFUSED = [
    pytest.param({"stop": strings(4)}, "too_many_items", "stop", id="one stop string over the limit"),
    pytest.param({"stop": "abcdef"}, "invalid_field", "stop", id="a stop string one character too long"),
    pytest.param({"stop": ["a", "abcdef"]}, "invalid_field", "stop[1]", id="a listed stop string too long"),
    pytest.param({"stop": ["a", 5]}, "invalid_field", "stop[1]", id="a stop that is not a string"),
    pytest.param({"stop": {"a": 1}}, "invalid_field", "stop", id="a stop that is an object"),
    pytest.param({"stop_sequences": strings(4)}, "too_many_items", "stop_sequences", id="one stop sequence over"),
    pytest.param(
        {"dry_sequence_breakers": strings(4)}, "too_many_items", "dry_sequence_breakers", id="one DRY breaker over"
    ),
    pytest.param({"bad_words": strings(3)}, "too_many_items", "bad_words", id="one bad word over the limit"),
    pytest.param({"bad_words": ["abcdef"]}, "invalid_field", "bad_words[0]", id="a bad word too long"),
    pytest.param({"bad_words": "word"}, "invalid_field", "bad_words", id="bad words as one string"),
    pytest.param({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "too_many_items", "logit_bias", id="one logit bias over"),
    pytest.param({"logit_bias": {"a": 1}}, "invalid_field", "logit_bias.a", id="a bias keyed by no token id"),
    pytest.param({"logit_bias": {"-1": 1}}, "invalid_field", "logit_bias.-1", id="a bias of a negative token id"),
    pytest.param({"logit_bias": {"5": 100.5}}, "invalid_field", "logit_bias.5", id="a bias above 100"),
    pytest.param({"logit_bias": {"5": True}}, "invalid_field", "logit_bias.5", id="a bias that is a boolean"),
    pytest.param({"logit_bias": [1, 2]}, "invalid_field", "logit_bias", id="logit_bias as an array"),
    pytest.param({"top_logprobs": 4}, "invalid_field", "top_logprobs", id="top_logprobs one over the limit"),
    pytest.param({"top_logprobs": -1}, "invalid_field", "top_logprobs", id="top_logprobs -1 (the whole vocabulary)"),
    pytest.param({"prompt_logprobs": -1}, "invalid_field", "prompt_logprobs", id="prompt_logprobs -1"),
    pytest.param({"n_probs": 4}, "invalid_field", "n_probs", id="llama.cpp's n_probs over the limit"),
    pytest.param({"logprobs": 4}, "invalid_field", "logprobs", id="completions' logprobs over the limit"),
    pytest.param({"top_logprobs": True}, "invalid_field", "top_logprobs", id="top_logprobs as a boolean"),
    pytest.param({"stop_token_ids": [0] * 5}, "too_many_items", "stop_token_ids", id="one stop token id over"),
    pytest.param({"allowed_token_ids": [0] * 5}, "too_many_items", "allowed_token_ids", id="one allowed id over"),
    pytest.param({"allowed_token_ids": [1, -2]}, "invalid_field", "allowed_token_ids", id="a negative token id"),
    pytest.param({"stop_token_ids": ["1"]}, "invalid_field", "stop_token_ids", id="a token id as a string"),
    pytest.param({"guided_choice": strings(5)}, "too_many_items", "guided_choice", id="one guided choice over"),
    pytest.param({"guided_choice": ["a", 1]}, "invalid_field", "guided_choice", id="a choice that is not a string"),
    pytest.param(
        {"structured_outputs": {"choice": strings(5)}},
        "too_many_items",
        "structured_outputs.choice",
        id="one structured-output choice over",
    ),
    pytest.param(
        {"response_format": {"type": "structural_tag", "structures": [{}] * 5}},
        "too_many_items",
        "response_format.structures",
        id="one structural-tag structure over",
    ),
    pytest.param(
        {"response_format": {"type": "structural_tag", "triggers": ["<f"] * 5}},
        "too_many_items",
        "response_format.triggers",
        id="one structural-tag trigger over",
    ),
    pytest.param({"include": strings(5)}, "too_many_items", "include", id="one include entry over"),
    pytest.param({"metadata": {f"k{i}": "v" for i in range(17)}}, "too_many_items", "metadata", id="17 metadata pairs"),
    pytest.param({"metadata": {"k" * 65: "v"}}, "invalid_field", "metadata", id="a metadata key of 65 characters"),
    pytest.param({"metadata": {"k": "v" * 513}}, "invalid_field", "metadata.k", id="a metadata value of 513"),
    pytest.param({"metadata": {"k": 5}}, "invalid_field", "metadata.k", id="a metadata value that is no string"),
    pytest.param({"metadata": ["k"]}, "invalid_field", "metadata", id="metadata as an array"),
    pytest.param({"seed": 2**63}, "invalid_field", "seed", id="a seed beyond 64 bits"),
    pytest.param({"seed": True}, "invalid_field", "seed", id="a seed that is a boolean"),
    pytest.param({"seed": 1.5}, "invalid_field", "seed", id="a seed that is a fraction"),
]


@pytest.mark.parametrize(("body", "code", "param"), REFUSED)
def test_a_feature_beyond_its_bound_is_refused_naming_it(body: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_engine_fields(body, LIMITS)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)


def test_a_list_is_counted_before_any_entry_is_read() -> None:
    """A long list of malformed entries is refused for its length: no entry of it was walked."""
    with pytest.raises(InvalidRequest) as refused:
        check_engine_fields({"stop": [object()] * 10_000}, LIMITS)
    assert (refused.value.code, refused.value.param) == ("too_many_items", "stop")
    assert "10000 strings; the limit is 3" in refused.value.message


DEFAULTS = [
    pytest.param("max_stop_sequences", 16, id="16 stop strings"),
    pytest.param("max_stop_chars", 256, id="256 characters a stop string"),
    pytest.param("max_bad_words", 128, id="128 bad words"),
    pytest.param("max_logit_bias", 300, id="300 logit biases"),
    pytest.param("max_logprobs", 20, id="20 logprobs"),
    pytest.param("max_list_items", 1024, id="1024 entries for the other lists"),
]


@pytest.mark.parametrize(("name", "value"), DEFAULTS)
def test_the_default_bounds_are_generous_for_real_clients_and_far_below_the_abuse(name: str, value: int) -> None:
    assert getattr(RequestLimits(), name) == value


# --- the wiring: every API checks the features it takes --------------------------------------


def _takers() -> list[Any]:
    return [
        pytest.param(dialect, name, id=f"{dialect.name}: {name}")
        for dialect in DIALECTS.values()
        for name in sorted(dialect.fields & FIELD_CHECKS.keys())
    ]


OVER: dict[str, Any] = {
    "stop": strings(17),
    "stop_sequences": strings(17),
    "dry_sequence_breakers": strings(17),
    "bad_words": strings(129),
    "logit_bias": {str(i): 1 for i in range(301)},
    "top_logprobs": 21,
    "prompt_logprobs": 21,
    "n_probs": 21,
    "logprobs": 21,
    "stop_token_ids": [1] * 1025,
    "allowed_token_ids": [1] * 1025,
    "guided_choice": strings(1025),
    "structured_outputs": {"choice": strings(1025)},
    "response_format": {"type": "structural_tag", "structures": [{}] * 1025},
    "include": strings(1025),
    "metadata": {f"k{i}": "v" for i in range(17)},
    "seed": 2**64,
}
"""Each checked field one over its default bound."""


def test_every_checked_field_has_a_value_over_its_default_bound_here() -> None:
    assert OVER.keys() == FIELD_CHECKS.keys()


@pytest.mark.parametrize(("dialect", "name"), _takers())
def test_every_api_that_takes_a_feature_refuses_it_beyond_its_default_bound(dialect: Any, name: str) -> None:
    body = {**SAMPLES[dialect.name].with_prompt("Hi"), name: copy.deepcopy(OVER[name])}
    with pytest.raises(InvalidRequest) as refused:
        dialect.screen(body, RequestLimits(), NO_GRANTS)
    assert refused.value.code in ("too_many_items", "invalid_field")
    assert refused.value.param is not None
    assert refused.value.param.startswith(name)
