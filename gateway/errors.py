"""Every error the gateway answers with, and the one function that renders it.

The tree (status, ``code``):

    GatewayError
    ├── InvalidRequest         400  invalid_json | invalid_field | too_deep | too_many_messages
    │                               | prompt_too_long | max_tokens_too_large | n_too_large
    │                               | unsupported_field | duplicate_key | duplicate_header
    │                               | media_url_not_allowed
    │                               | too_complex | too_many_content_parts | too_many_tools
    │                               | conflicting_max_tokens | too_many_items | content_part_not_allowed
    │                               | tool_type_not_allowed | server_url_not_allowed
    ├── AuthenticationFailed   401  missing_api_key | invalid_api_key
    ├── Forbidden              403  admin_disabled | not_admin (the admin guard: gateway/server/admin.py)
    ├── NotFound               404  not_found | previous_response_not_found | api_not_served
    │   └── ModelNotFound      404  model_not_found: a model that does not exist, or a group's target
    │       └── ModelNotAllowed     the same answer for a model the tenant may not use (outcome
    │                               label model_not_allowed: the operator may tell them apart)
    ├── MethodNotAllowed       405  method_not_allowed
    ├── RequestTimeout         408  request_timeout (headers or body too slow: gateway/server/connections.py)
    ├── PayloadTooLarge        413  request_too_large
    ├── UnsupportedMediaType   415  unsupported_media_type
    ├── HeadersTooLarge        431  request_header_too_large (gateway/server/connections.py)
    ├── Overloaded             429  tenant_concurrency_limited | tenant_rate_limited | tenant_token_limited
    │                          503  queue_full | queue_timeout | deadline_unmeetable | draining | starting
    │                               | model_removed | too_many_connections (gateway/server/connections.py)
    │                               | worker_unavailable (operator listener of --workers N: gateway/workers/)
    │                               | response_lookup_unavailable (a follow-up whose holder Redis did not
    │                                 tell in time: retry, gateway/responses/affinity.py)
    │                               | limits_unavailable (a limited tenant while Redis is lost and
    │                                 state.on_store_loss is closed: gateway/admission/tenant_limits.py)
    ├── InternalError          500  internal_error (a gateway bug; never caused by input)
    ├── NoHealthyBackend       503  no_healthy_backend | no_backend_for_tenant
    ├── UpstreamError          502  upstream_error | upstream_connect_error | upstream_protocol_error
    │   │                           | upstream_disconnected | breaker_open
    │   │                           | upstream_auth_failed | upstream_misconfigured
    │   └── UpstreamUnavailable    503  upstream_unavailable | upstream_overloaded (Retry-After: the gateway's)
    ├── UpstreamRejected       400  upstream_rejected (the engine judged the request itself invalid)
    └── UpstreamTimeout        504  upstream_timeout | upstream_stalled | deadline_exceeded

How a backend's own error answer becomes one of these (and what of it a client may read) is
the rule of ``gateway/upstream/errors.py``.

Each error carries its HTTP ``status``, the OpenAI ``type`` the official SDK expects, a ``code``
from the closed list ``ErrorCode`` (the ``outcome`` label of ``gateway_requests_total``) and an
optional ``param``. Whether a failed attempt is retried is not the error's to say: it depends on
what was sent and what came back (``gateway/upstream/retry.py``). ``body`` renders the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``; an API with an error shape of its own
renders it through its dialect (``Dialect.error_body``: Anthropic's for Messages). Tracebacks
never go on the wire: the one catch-all of the request path (``gateway/pipeline/handler.py``)
logs them and answers 500 ``internal_error`` (or ends a started stream with its error event).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum

import orjson


class GatewayError(Exception):
    """Base class: an answer the gateway gives instead of the backend's."""

    status: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"
    outcome: str | None = None
    """The outcome label (``code_of``) when it must differ from the code the client reads."""

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
        self.code = ErrorCode(code or self.default_code)  # ValueError for a code not in the list
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


class Forbidden(GatewayError):
    """A known key that may not do what it asked: the admin endpoints only (a model a tenant may
    not use is a ``ModelNotAllowed``, answered as a 404)."""

    status = 403
    error_type = "permission_error"
    default_code = "not_admin"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    """404 ``model_not_found`` for ``model``, the name the client sent, in OpenAI's words: a name
    no client may call (none such, or a group's internal target, fallback or shadow)."""

    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        message = f"The model `{model}` does not exist or you do not have access to it."
        super().__init__(message, code="model_not_found", param="model")


class ModelNotAllowed(ModelNotFound):
    """A model the tenant may not use, answered byte for byte as one that does not exist (OpenAI
    does the same): a 403 would tell a tenant that the model exists. Only the outcome label of the
    request (``code_of``: metrics, trace log) says ``model_not_allowed``, for the operator."""

    outcome = "model_not_allowed"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class UnsupportedMediaType(GatewayError):
    """The request's ``Content-Type`` is not JSON (see ``intake.require_json_content_type``)."""

    status = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class RequestTimeout(GatewayError):
    """The request's headers or body did not arrive in time (a slow or stalled client)."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class HeadersTooLarge(GatewayError):
    status = 431
    error_type = "invalid_request_error"
    default_code = "request_header_too_large"


class Overloaded(GatewayError):
    """Admission said no; the status (429 tenant limit, 503 system full) and Retry-After vary."""

    error_type = "rate_limit_error"

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


class UpstreamError(GatewayError):
    status = 502
    error_type = "server_error"
    default_code = "upstream_error"


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "server_error"
    default_code = "upstream_timeout"


class UpstreamUnavailable(UpstreamError):
    """The backend cannot take the request now (503, or 429 after the gateway's retries).

    ``Retry-After`` is the gateway's own hint (``upstream_errors.gateway_retry_after``), never
    the backend's header.
    """

    status = 503
    default_code = "upstream_unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: float) -> None:
        retry_after = str(max(1, math.ceil(retry_after_s)))
        retry_after_ms = str(max(1, math.ceil(retry_after_s * 1000)))
        super().__init__(message, code=code, headers={"retry-after": retry_after, "retry-after-ms": retry_after_ms})
        self.retry_after_s = retry_after_s


class UpstreamRejected(GatewayError):
    """The engine judged the request itself invalid (a backend 400/413/422): the client's to fix."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "upstream_rejected"


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error object, as bytes."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def sse_error_event(error: GatewayError) -> bytes:
    """The error as one server-sent event, the way vLLM ends a failed stream."""
    return b"data: " + error.body() + b"\n\n"


class ErrorCode(StrEnum):
    """Every ``code`` the gateway answers with (and the ``outcome`` label of a failed request).

    The one list: ``GatewayError`` refuses a code that is not here, so dashboards and alerts can
    be written against a closed set. Grouped as the tree in the module docstring.
    """

    # 400 InvalidRequest: the request itself
    INVALID_JSON = "invalid_json"
    INVALID_FIELD = "invalid_field"
    INVALID_HEADER = "invalid_header"
    INVALID_PRIORITY = "invalid_priority"
    DUPLICATE_KEY = "duplicate_key"
    DUPLICATE_HEADER = "duplicate_header"
    UNSUPPORTED_FIELD = "unsupported_field"
    MEDIA_URL_NOT_ALLOWED = "media_url_not_allowed"
    TOO_DEEP = "too_deep"
    TOO_COMPLEX = "too_complex"
    TOO_MANY_MESSAGES = "too_many_messages"
    TOO_MANY_CONTENT_PARTS = "too_many_content_parts"
    TOO_MANY_TOOLS = "too_many_tools"
    TOO_MANY_ITEMS = "too_many_items"
    CONTENT_PART_NOT_ALLOWED = "content_part_not_allowed"
    TOOL_TYPE_NOT_ALLOWED = "tool_type_not_allowed"
    SERVER_URL_NOT_ALLOWED = "server_url_not_allowed"
    PROMPT_TOO_LONG = "prompt_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    CONFLICTING_MAX_TOKENS = "conflicting_max_tokens"
    N_TOO_LARGE = "n_too_large"
    UPSTREAM_REJECTED = "upstream_rejected"
    # 401 AuthenticationFailed
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    # 403 Forbidden: the admin guard
    ADMIN_DISABLED = "admin_disabled"
    NOT_ADMIN = "not_admin"
    # 404, 405, 408, 413, 415, 431: the request's shape on the wire
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_ALLOWED = "model_not_allowed"  # an outcome label only: answered as model_not_found
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    API_NOT_SERVED = "api_not_served"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    REQUEST_HEADER_TOO_LARGE = "request_header_too_large"
    # 429 Overloaded: the tenant's own limits
    TENANT_CONCURRENCY_LIMITED = "tenant_concurrency_limited"
    TENANT_RATE_LIMITED = "tenant_rate_limited"
    TENANT_TOKEN_LIMITED = "tenant_token_limited"
    # 503 Overloaded: the system is full, starting or stopping
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    DRAINING = "draining"
    STARTING = "starting"
    MODEL_REMOVED = "model_removed"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    WORKER_UNAVAILABLE = "worker_unavailable"
    RESPONSE_LOOKUP_UNAVAILABLE = "response_lookup_unavailable"
    LIMITS_UNAVAILABLE = "limits_unavailable"
    # 500 InternalError; 503 NoHealthyBackend
    INTERNAL_ERROR = "internal_error"
    NO_HEALTHY_BACKEND = "no_healthy_backend"
    NO_BACKEND_FOR_TENANT = "no_backend_for_tenant"
    # 502 UpstreamError, 503 UpstreamUnavailable, 504 UpstreamTimeout
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_CONNECT_ERROR = "upstream_connect_error"
    UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    UPSTREAM_AUTH_FAILED = "upstream_auth_failed"
    UPSTREAM_MISCONFIGURED = "upstream_misconfigured"
    BREAKER_OPEN = "breaker_open"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_OVERLOADED = "upstream_overloaded"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_STALLED = "upstream_stalled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    # Not answered to anyone: a client that left before its answer (the outcome of its request)
    CLIENT_DISCONNECTED = "client_disconnected"


def code_of(error: GatewayError) -> ErrorCode:
    """The outcome label of a request that ended in ``error``: its code, unless the error keeps a
    reason from the client that the operator may read (``ModelNotAllowed``)."""
    return ErrorCode(error.outcome) if error.outcome is not None else error.code
