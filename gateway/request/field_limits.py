"""Field checks against the model's and the policy's limits that need no dialect: the prompt's 400,
the ``n`` cap, and how many completions a body asks for.

Why here, below the dialects, and not with ``build_request`` (``gateway/admission/build.py``):
the dialects raise ``prompt_too_long`` from their own prompt estimates, and the tenant's limits
reserve the output bound ``choices`` times; building the ``InferenceRequest`` needs a dialect and
so sits above them. These read only the body, the policy and the errors, so both can import them
without a circle between the stages (issue 29).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.policy.model import ModelPolicy, RequestLimits


def prompt_too_long(field: str, model: ModelPolicy, size: str) -> InvalidRequest:
    """400 ``prompt_too_long`` naming the prompt's ``field`` and ``size`` ("about N tokens (estimated)")."""
    return InvalidRequest(
        f"The prompt has {size}; model '{model.name}' accepts at most {model.max_prompt_tokens}.",
        code="prompt_too_long",
        param=field,
    )


def check_n(body: dict[str, Any], limits: RequestLimits) -> None:
    """400 unless the body's ``n``, when given, is a positive integer within ``limits.max_n``."""
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
