"""Every error the gateway answers with, and the one function that renders it.

The tree (status, ``code``):

    GatewayError
    ├── InvalidRequest         400  invalid_json | invalid_field | too_deep | too_many_messages
    │                               | prompt_too_long | max_tokens_too_large | n_too_large
    │                               | too_complex | too_many_content_parts | too_many_tools
    │                               | conflicting_max_tokens
    ├── AuthenticationFailed   401  missing_api_key | invalid_api_key
    ├── ModelNotAllowed        403  model_not_allowed
    ├── NotFound               404  model_not_found | not_found
    ├── MethodNotAllowed       405  method_not_allowed
    ├── PayloadTooLarge        413  request_too_large
    ├── Overloaded             429/503 (admission: rate limits, queue full, draining, ...)
    ├── InternalError          500  internal_error (a gateway bug; never caused by input)
    ├── NoHealthyBackend       503  no_healthy_backend
    ├── UpstreamError          502  upstream_error | upstream_connect_error | upstream_protocol_error
    └── UpstreamTimeout        504  upstream_timeout

Each error carries its HTTP ``status``, the OpenAI ``type`` the official SDK expects, a ``code``
an operator can grep for, an optional ``param`` and whether a retry could succeed. The body is
always the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``; tracebacks never
go on the wire (the outermost handler in ``app.py`` logs them and answers a generic 500-free 502).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import orjson


class GatewayError(Exception):
    """Base class: an answer the gateway gives instead of the backend's."""

    status: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.code, self.param)


class InvalidRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_field"


class AuthenticationFailed(GatewayError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotAllowed(GatewayError):
    status = 403
    error_type = "permission_error"
    default_code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class Overloaded(GatewayError):
    """Admission said no; the status (429 tenant limit, 503 system full) and Retry-After vary."""

    error_type = "rate_limit_error"
    retryable = True

    def __init__(self, message: str, *, status: int, code: str, retry_after_s: float) -> None:
        # Retry-After in whole seconds (HTTP), retry-after-ms exact (read first by the OpenAI SDKs).
        retry_after = str(max(1, math.ceil(retry_after_s)))
        retry_after_ms = str(max(1, math.ceil(retry_after_s * 1000)))
        super().__init__(message, code=code, headers={"retry-after": retry_after, "retry-after-ms": retry_after_ms})
        self.status = status
        self.retry_after_s = retry_after_s
        if status >= 500:
            self.error_type = "server_error"


class InternalError(GatewayError):
    """A bug in the gateway; the message is generic, the traceback goes to the log only."""

    status = 500
    error_type = "server_error"
    default_code = "internal_error"


class NoHealthyBackend(GatewayError):
    status = 503
    error_type = "server_error"
    default_code = "no_healthy_backend"
    retryable = True


class UpstreamError(GatewayError):
    status = 502
    error_type = "server_error"
    default_code = "upstream_error"
    retryable = True


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "server_error"
    default_code = "upstream_timeout"
    retryable = True


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error object, as bytes."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def sse_error_event(error: GatewayError) -> bytes:
    """The error as one server-sent event, the way vLLM ends a failed stream."""
    return b"data: " + error.body() + b"\n\n"
