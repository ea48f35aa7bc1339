"""Field checks and policy limits that turn a parsed body into an ``InferenceRequest``.

Checks are the ones a backend would fail on anyway, done here so that the client gets a
clear 400 naming the field and the limit, and so that no malformed request costs a backend
slot: types of the fields the gateway relies on, message count, estimated prompt tokens,
the output-length bound (every alias read once, ``gateway/output_length.py``, then capped:
rejected or clamped, per policy) and the ``n`` cap. Fields the gateway does not act on are
passed through untouched for the backend to judge.

**Order: cheapest first.** A refused request should cost as little CPU as possible, so the
checks whose cost does not grow with the body come first (flags, ``n``, the output bound),
then the structural bounds that cap what the expensive steps will walk (message count, parts
per message, tools, prompt list lengths: ``len`` only), and only then the prompt estimate,
which reads every text. The body's size, depth and container count were bounded before it
was parsed (``gateway/json_bounds.py``).

**The output bound** is ``InferenceRequest.max_tokens``: what the client asked for (any
alias), else the model's ``default_max_tokens``, else its ``max_output_tokens``, and never
above ``max_output_tokens``. The body is not edited here: each attempt's body gets exactly
the field its backend obeys (``output_length.fit_output_length``), so that a backend never
falls back on its own default, which is its whole remaining context.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.output_length import requested_output_length
from gateway.policy.model import ModelPolicy, OverLimit, RequestLimits
from gateway.tokens import TokenEstimator, chat_prompt_tokens, prompt_input_tokens
from gateway.types import Api, InferenceRequest

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_PROMPT_FIELD = {Api.CHAT: "messages", Api.COMPLETIONS: "prompt", Api.EMBEDDINGS: "input"}


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string.", param="model")
    return model


def build_request(
    *,
    api: Api,
    body: dict[str, Any],
    raw_body: bytes,
    request_id: str,
    arrival: float,
    model_policy: ModelPolicy,
    limits: RequestLimits,
    estimator: TokenEstimator,
) -> InferenceRequest:
    """Validate ``body`` for ``api`` against the model's and the policy's limits."""
    stream, wants_usage = _stream_flags(body, api)
    _check_n(body, limits)
    max_tokens = 0 if api is Api.EMBEDDINGS else output_bound(body, model_policy, limits.max_tokens_over_limit)
    prompt_tokens = _prompt_tokens(api, body, model_policy, limits, estimator)
    if prompt_tokens > model_policy.max_prompt_tokens:
        raise _prompt_too_long(api, model_policy, f"about {prompt_tokens} tokens (estimated)")
    request = InferenceRequest(
        request_id=request_id,
        api=api,
        model=model_policy.name,
        body=body,
        raw_body=raw_body,
        stream=stream,
        client_wants_usage=wants_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        arrival=arrival,
    )
    if model_policy.upstream_name is not None:
        body["model"] = model_policy.upstream_name
        request.body_modified = True
    return request


def output_bound(body: dict[str, Any], model: ModelPolicy, over_limit: OverLimit) -> int:
    """The request's one output-token bound, after the model's cap (reject or clamp)."""
    value, field = requested_output_length(body)
    if value is None:
        return model.default_max_tokens or model.max_output_tokens
    if value <= model.max_output_tokens:
        return value
    if over_limit is OverLimit.REJECT:
        raise InvalidRequest(
            f"'{field}' is {value}; model '{model.name}' allows at most {model.max_output_tokens}.",
            code="max_tokens_too_large",
            param=field,
        )
    return model.max_output_tokens


def _prompt_too_long(api: Api, model: ModelPolicy, size: str) -> InvalidRequest:
    return InvalidRequest(
        f"The prompt has {size}; model '{model.name}' accepts at most {model.max_prompt_tokens}.",
        code="prompt_too_long",
        param=_PROMPT_FIELD[api],
    )


def _stream_flags(body: dict[str, Any], api: Api) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    if stream and api is Api.EMBEDDINGS:
        raise InvalidRequest("Embeddings cannot be streamed.", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean.", param="stream_options.include_usage")
    return stream, include_usage


def _prompt_tokens(
    api: Api, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
) -> int:
    if api is Api.CHAT:
        _check_messages(body.get("messages"), limits)
        _check_tools(body, limits.max_tools)
        return chat_prompt_tokens(body, estimator, limits.media_tokens)
    field = _PROMPT_FIELD[api]
    value = body.get(field)
    if isinstance(value, list):
        # Each item is at least a token (an empty string is refused all the same), and the
        # lengths are known without reading an item: a long list is refused before it is read.
        items = sum(map(len, value)) if value and set(map(type, value)) == {list} else len(value)
        if items > model.max_prompt_tokens:
            raise _prompt_too_long(api, model, f"at least {items} tokens")
    if not _is_text_or_tokens(value):
        raise InvalidRequest(f"'{field}' is required: a string, a list of strings, or token ids.", param=field)
    return prompt_input_tokens(value, estimator)


def _check_messages(messages: Any, limits: RequestLimits) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array.", param="messages")
    if len(messages) > limits.max_messages:
        raise InvalidRequest(
            f"'messages' has {len(messages)} entries; the limit is {limits.max_messages}.",
            code="too_many_messages",
            param="messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}.", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array of parts.",
                param=f"messages[{i}].content",
            )
        if len(content) > limits.max_content_parts:
            raise InvalidRequest(
                f"'messages[{i}].content' has {len(content)} parts; the limit is {limits.max_content_parts}.",
                code="too_many_content_parts",
                param=f"messages[{i}].content",
            )


def _check_tools(body: dict[str, Any], max_tools: int) -> None:
    for name in ("tools", "functions"):
        tools = body.get(name)
        if tools is None:
            continue
        if not isinstance(tools, list):
            raise InvalidRequest(f"'{name}' must be an array.", param=name)
        if len(tools) > max_tools:
            raise InvalidRequest(
                f"'{name}' has {len(tools)} entries; the limit is {max_tools}.", code="too_many_tools", param=name
            )


_TOKEN_TYPES = {int}


def _is_text_or_tokens(value: Any) -> bool:
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


def _check_n(body: dict[str, Any], limits: RequestLimits) -> None:
    n = body.get("n")
    if n is None:
        return
    if not _is_positive_int(n):
        raise InvalidRequest("'n' must be a positive integer.", param="n")
    if n > limits.max_n:
        raise InvalidRequest(f"'n' is {n}; the limit is {limits.max_n}.", code="n_too_large", param="n")


def choices(body: dict[str, Any]) -> int:
    """How many completions the request asks for (``n``, validated): its output bound applies to each."""
    n = body.get("n")
    return n if isinstance(n, int) and _is_positive_int(n) else 1


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
