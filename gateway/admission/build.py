"""Field checks and policy limits that turn a parsed body into an ``InferenceRequest``.

Checks are the ones a backend would fail on anyway, done here so that the client gets a
clear 400 naming the field and the limit, and so that no malformed request costs a backend
slot: types of the fields the gateway relies on, message count, estimated prompt tokens,
the output-length bound (every alias read once, ``gateway/request/output_length.py``, then capped:
rejected or clamped, per policy) and the ``n`` cap. Fields the gateway does not act on are
passed through untouched for the backend to judge. What differs per API (the stream flags, the
output aliases, the prompt's structure and estimate) is the request's dialect's
(``gateway/dialects/``); this module runs the steps in order and applies the model's caps. The
checks that need no dialect (``n``, the prompt's 400) are ``gateway/request/field_limits.py``, below
the dialects, which raise that 400 too.

**Order: cheapest first.** A refused request should cost as little CPU as possible, so the
checks whose cost does not grow with the body come first (flags, ``n``, the output bound),
then the structural bounds that cap what the expensive steps will walk (message count, parts
per message, tools, prompt list lengths: ``len`` only), and only then the prompt estimate,
which reads every text (the last two are ``Dialect.prompt_tokens``). The body's size, depth
and container count were bounded before it was parsed (``gateway/request/json_bounds.py``).

**The output bound** is ``InferenceRequest.max_tokens``: what the client asked for (any
alias), else the model's ``default_max_tokens``, else its ``max_output_tokens``, and never
above ``max_output_tokens``. The body is not edited here: each attempt's body gets exactly
the field its backend obeys (``output_length.fit_output_length``), so that a backend never
falls back on its own default, which is its whole remaining context.
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.base import Dialect
from gateway.errors import InvalidRequest
from gateway.policy.model import ModelPolicy, OverLimit, RequestLimits
from gateway.request.field_limits import check_n, prompt_too_long
from gateway.request.output_length import OUTPUT_LENGTH_FIELDS, requested_output_length
from gateway.request.tokens import TokenEstimator
from gateway.types import InferenceRequest


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string.", param="model")
    return model


def build_request(
    *,
    api: Dialect,
    body: dict[str, Any],
    raw_body: bytes,
    request_id: str,
    arrival: float,
    model_policy: ModelPolicy,
    limits: RequestLimits,
    estimator: TokenEstimator,
) -> InferenceRequest:
    """Validate ``body`` for ``api`` against the model's and the policy's limits."""
    stream, wants_usage = api.stream_flags(body)
    check_n(body, limits)
    aliases = api.output_aliases
    shown = as_called(model_policy, body)  # what every message below names the model
    max_tokens = output_bound(body, shown, limits.max_tokens_over_limit, aliases) if aliases else 0
    prompt_tokens = api.prompt_tokens(body, shown, limits, estimator)
    if prompt_tokens > shown.max_prompt_tokens:
        raise prompt_too_long(api.prompt_field, shown, f"about {prompt_tokens} tokens (estimated)")
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
    served = model_policy.upstream_name or model_policy.name
    if body.get("model") != served:  # a group's public name, or a model's alias: the engine's name goes up
        body["model"] = served
        request.body_modified = True
    return request


def as_called(model: ModelPolicy, body: dict[str, Any]) -> ModelPolicy:
    """``model`` (a group's target, fallback, or a model a continued answer lives on) under the
    name the client called it, the body's ``model``: the only name an error may show, since a
    group's targets are internal and never callable by name. The limits are the target's."""
    called = body.get("model")
    if not isinstance(called, str) or called == model.name:
        return model
    return model.model_copy(update={"name": called})


def output_bound(
    body: dict[str, Any], model: ModelPolicy, over_limit: OverLimit, aliases: tuple[str, ...] = OUTPUT_LENGTH_FIELDS
) -> int:
    """The request's one output-token bound, after the model's cap (reject or clamp)."""
    value, field = requested_output_length(body, aliases)
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
