"""Which body fields a client may send, and the fields only the gateway sets.

An engine behind the gateway reads far more than the OpenAI API: vLLM alone takes scheduling
priority, its prefix-cache salt, KV-transfer instructions for disaggregated serving, data-parallel
placement, a whole chat template, free-form extension arguments. Each of those is the platform's
decision, not a tenant's, so the gateway forwards only what it knows to be safe. The rule:

1. A field in the API's allowlist passes: the OpenAI API's request fields plus the engines'
   sampling and structured-output extras (vLLM's ``ChatCompletionRequest``,
   ``CompletionRequest`` and ``EmbeddingCompletionRequest``, SGLang's and llama.cpp's common
   ones). Each extra shapes only its own request's output, at a cost bounded by its tokens.
   Each API's list is its dialect's ``fields`` (``gateway/dialects/``), built from the shared
   sets here (``SAMPLING_EXTRAS``, ``OUTPUT_LENGTH_ALIASES``).
2. A field the gateway owns is never taken from a client, whatever the policy says (the names
   and reasons are the policy's too, ``gateway/policy/body_names.py``: it refuses them as extras):
   * stripped silently (``STRIPPED_FIELDS``) when the gateway itself provides what the field is
     for: the scheduling priority comes from the tenant's class (``engine_priority``), the
     prefix-cache salt from the tenant's scope, the request id from ``x-request-id``. Clients
     written against an engine send these routinely; the gateway's value (or the engine's
     default) applies instead, and a client's ``priority`` can never beat its class.
   * refused (``REFUSED_FIELDS``, 400 ``unsupported_field``) when the field steers the engine
     beyond the request: KV transfer from another host, placement on a data-parallel rank or a
     llama.cpp slot, a request-supplied Jinja template, adapters loaded by path, extension args.
     No tenant has a use for them; silently dropping one would hide a probe.
3. Any other field is refused with 400 ``unsupported_field``, as OpenAI answers an unknown
   argument. A platform that needs one (``mm_processor_kwargs``, ``documents``, ...) lists it
   in ``limits.extra_body_fields``; the policy load refuses an owned field there.
4. Objects the gateway reads have their own allowlist: ``stream_options`` (``include_usage``,
   ``continuous_usage_stats``, ``check_stream_options``), and chat's ``chat_template_kwargs``
   (template switches only, ``gateway/dialects/chat.py``). A dialect's ``screen`` applies
   ``screen_fields`` then the rules of the objects its API has.
5. An allowed field is not a free one: an engine feature whose cost no token bound limits
   (stop strings, banned words, logit biases, token-id lists, logprobs) is bounded by the
   policy's ``limits`` (``gateway/dialects/engine_fields.py``), and content parts and tools are
   held to each API's allowlist and the tenant's opt-ins (``gateway/dialects/allowlists.py``).

Text that reaches the prompt outside ``messages``/``prompt``/``tools`` escapes the gateway's
prompt-token estimate and routing keys; that is why ``documents`` and long template arguments
are not in the default allowlist.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.errors import InvalidRequest
from gateway.policy.body_names import REFUSED_FIELDS, STRIPPED_FIELDS


class BodyLimits(Protocol):
    """What screening reads of the policy's ``limits`` (``gateway.policy.model.RequestLimits``).

    A protocol, not the policy class: screening needs this one field of it."""

    @property
    def extra_body_fields(self) -> frozenset[str]: ...


SAMPLING_EXTRAS = frozenset(
    {
        # vLLM sampling parameters
        "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
        "bad_words", "add_special_tokens", "return_tokens_as_token_ids", "return_token_ids",
        "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
        # structured output (vLLM's current and older spellings, SGLang's, llama.cpp's)
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar", "guided_whitespace_pattern", "regex", "ebnf", "json_schema", "grammar",
        # SGLang
        "no_stop_trim",
        # llama.cpp samplers
        "typical_p", "repeat_penalty", "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta",
        "n_probs", "min_keep", "dynatemp_range", "dynatemp_exponent", "xtc_probability", "xtc_threshold",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
        "top_n_sigma", "t_max_predict_ms", "timings_per_token", "post_sampling_probs",
    }
)  # fmt: skip
OUTPUT_LENGTH_ALIASES = frozenset({"max_tokens", "max_completion_tokens", "n_predict"})
"""Every name engines read an output bound from: all accepted on both generating APIs, because
validation normalises them into the request's one bound, refuses two that disagree, applies the
model's cap, and each attempt sends the bound in the one field its engine obeys
(``gateway/request/output_length.py``). None of them can bypass the cap."""

STREAM_OPTIONS_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})
_SHOWN_NAME_CHARS = 64


def screen_fields(allowed: frozenset[str], body: dict[str, Any], limits: BodyLimits) -> bool:
    """Refuse a field outside ``allowed`` (and the policy's extras), drop the owned ones; True
    when a field was dropped.

    Runs before any other check reads the body, so that nothing downstream acts on a field the
    client may not set. The common body (allowed fields only) costs one set comparison.
    """
    if body.keys() <= allowed:
        return False
    return _strip_or_refuse(body, allowed, limits.extra_body_fields)


def _strip_or_refuse(body: dict[str, Any], allowed: frozenset[str], extra: frozenset[str]) -> bool:
    owned = [name for name in body if name in STRIPPED_FIELDS]
    for name in body:
        if name in allowed or name in STRIPPED_FIELDS or name in extra:
            continue
        why = REFUSED_FIELDS.get(name)
        if why is not None:
            raise InvalidRequest(
                f"'{name}' is set by the gateway, never by a client: {why}.", code="unsupported_field", param=name
            )
        raise _unrecognized(name)
    for name in owned:
        del body[name]
    return bool(owned)


def shown(name: str) -> str:
    """A client's field name as echoed back: cut short, since a key can be as long as the body."""
    return name if len(name) <= _SHOWN_NAME_CHARS else name[:_SHOWN_NAME_CHARS] + "..."


def _unrecognized(name: str, within: str = "") -> InvalidRequest:
    name = shown(name)
    return InvalidRequest(
        f"Unrecognized request argument supplied: {within}{name}", code="unsupported_field", param=within + name
    )


def check_stream_options(options: Any) -> None:
    """``stream_options`` holds only the switches the gateway knows (``STREAM_OPTIONS_FIELDS``)."""
    if isinstance(options, dict):
        for name in options:
            if name not in STREAM_OPTIONS_FIELDS:
                raise _unrecognized(name, "stream_options.")
