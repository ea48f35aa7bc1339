"""Field checks and policy limits that turn a parsed body into an ``InferenceRequest``.

Checks are the ones a backend would fail on anyway, done here so that the client gets a
clear 400 naming the field and the limit, and so that no malformed request costs a backend
slot: types of the fields the gateway relies on, message count, estimated prompt tokens,
the ``max_tokens`` cap (rejected or clamped, per policy) and the ``n`` cap. Fields the
gateway does not act on are passed through untouched for the backend to judge.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.policy.model import ModelPolicy, OverLimit, RequestLimits
from gateway.tokens import TokenEstimator, chat_prompt_tokens, prompt_input_tokens
from gateway.types import Api, InferenceRequest

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


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
    prompt_tokens = _prompt_tokens(api, body, limits, estimator)
    if prompt_tokens > model_policy.max_prompt_tokens:
        raise InvalidRequest(
            f"The prompt has about {prompt_tokens} tokens (estimated); model '{model_policy.name}' "
            f"accepts at most {model_policy.max_prompt_tokens}.",
            code="prompt_too_long",
            param={Api.CHAT: "messages", Api.COMPLETIONS: "prompt", Api.EMBEDDINGS: "input"}[api],
        )
    _check_n(body, limits)
    request = InferenceRequest(
        request_id=request_id,
        api=api,
        model=model_policy.name,
        body=body,
        raw_body=raw_body,
        stream=stream,
        client_wants_usage=wants_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=0,
        arrival=arrival,
    )
    if api is not Api.EMBEDDINGS:
        request.max_tokens = _apply_max_tokens(request, model_policy, limits.max_tokens_over_limit)
    if model_policy.upstream_name is not None:
        body["model"] = model_policy.upstream_name
        request.body_modified = True
    return request


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


def _prompt_tokens(api: Api, body: dict[str, Any], limits: RequestLimits, estimator: TokenEstimator) -> int:
    if api is Api.CHAT:
        messages = body.get("messages")
        _check_messages(messages, limits.max_messages)
        assert isinstance(messages, list)
        return chat_prompt_tokens(messages, estimator)
    field = "prompt" if api is Api.COMPLETIONS else "input"
    value = body.get(field)
    if not _is_text_or_tokens(value):
        raise InvalidRequest(f"'{field}' is required: a string, a list of strings, or token ids.", param=field)
    return prompt_input_tokens(value, estimator)


def _check_messages(messages: Any, max_messages: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array.", param="messages")
    if len(messages) > max_messages:
        raise InvalidRequest(
            f"'messages' has {len(messages)} entries; the limit is {max_messages}.",
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
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array of parts.",
                param=f"messages[{i}].content",
            )


def _is_text_or_tokens(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(item, str) for item in value):
        return True
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return True
    return all(
        isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        for item in value
    )


def _check_n(body: dict[str, Any], limits: RequestLimits) -> None:
    n = body.get("n")
    if n is None:
        return
    if not _is_positive_int(n):
        raise InvalidRequest("'n' must be a positive integer.", param="n")
    if n > limits.max_n:
        raise InvalidRequest(f"'n' is {n}; the limit is {limits.max_n}.", code="n_too_large", param="n")


def _apply_max_tokens(request: InferenceRequest, model: ModelPolicy, over_limit: OverLimit) -> int:
    """The output-token bound of the request, after the policy's cap (reject or clamp)."""
    body = request.body
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(field)
    if value is None:
        if model.default_max_tokens is None:
            return model.max_output_tokens
        body["max_tokens"] = model.default_max_tokens
        request.body_modified = True
        return model.default_max_tokens
    if not _is_positive_int(value):
        raise InvalidRequest(f"'{field}' must be a positive integer.", param=field)
    if value <= model.max_output_tokens:
        return int(value)
    if over_limit is OverLimit.REJECT:
        raise InvalidRequest(
            f"'{field}' is {value}; model '{model.name}' allows at most {model.max_output_tokens}.",
            code="max_tokens_too_large",
            param=field,
        )
    body[field] = model.max_output_tokens
    request.body_modified = True
    return model.max_output_tokens


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
