"""The rule of ``gateway/upstream/errors.py``, as values: what a client may read of a failed backend.

The mapping of upstream statuses, the excerpt (what it keeps, what it redacts, where it cuts),
the error-body shapes of the engines, error events and 200s that are no answer. End to end,
through real servers, the same rule is checked in ``tests/pipeline/test_handler.py``.
"""

from __future__ import annotations

import time

import orjson
import pytest

from gateway.errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.errors import (
    EXCERPT_CHARS,
    Redactor,
    answer_error,
    event_error,
    excerpt,
    gateway_retry_after,
    mapped_error,
    status_error,
)

SECRET = "backend-secret-123"
REDACTOR = Redactor([SECRET, "short"], ["vllm-0", "10.9.8.7"])
CONTEXT_LENGTH = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion."
)


@pytest.mark.parametrize(
    ("status", "client_status", "code", "error_class"),
    [
        pytest.param(400, 400, "upstream_rejected", UpstreamRejected, id="400 is a rejection the client can fix"),
        pytest.param(413, 400, "upstream_rejected", UpstreamRejected, id="413 is a rejection"),
        pytest.param(422, 400, "upstream_rejected", UpstreamRejected, id="422 is a rejection"),
        pytest.param(401, 502, "upstream_auth_failed", UpstreamError, id="401 is the gateway's credential, a 502"),
        pytest.param(403, 502, "upstream_auth_failed", UpstreamError, id="403 is the gateway's credential"),
        pytest.param(407, 502, "upstream_auth_failed", UpstreamError, id="407 is the gateway's proxy credential"),
        pytest.param(404, 502, "upstream_misconfigured", UpstreamError, id="404 is a misconfigured backend"),
        pytest.param(405, 502, "upstream_misconfigured", UpstreamError, id="405 is a misconfigured backend"),
        pytest.param(302, 502, "upstream_misconfigured", UpstreamError, id="a redirect is a misconfigured URL"),
        pytest.param(408, 504, "upstream_timeout", UpstreamTimeout, id="408 is a timeout"),
        pytest.param(504, 504, "upstream_timeout", UpstreamTimeout, id="504 is a timeout"),
        pytest.param(429, 503, "upstream_overloaded", UpstreamUnavailable, id="429 is an overloaded backend, a 503"),
        pytest.param(503, 503, "upstream_unavailable", UpstreamUnavailable, id="503 stays a 503 of the gateway"),
        pytest.param(500, 502, "upstream_error", UpstreamError, id="500 is a 502"),
        pytest.param(502, 502, "upstream_error", UpstreamError, id="502 is a 502 of the gateway"),
        pytest.param(418, 502, "upstream_error", UpstreamError, id="an odd 4xx is the backend's failure"),
        pytest.param(204, 502, "upstream_protocol_error", UpstreamError, id="another 2xx is no answer"),
    ],
)
def test_each_upstream_status_maps_to_the_gateway_s_own_error(
    status: int, client_status: int, code: str, error_class: type[Exception]
) -> None:
    error = mapped_error(status, detail="the engine's words")
    assert type(error) is error_class
    assert (error.status, error.code) == (client_status, code)
    assert error.error_type == ("invalid_request_error" if client_status == 400 else "server_error")
    assert str(status) not in error.message, "the upstream status is for logs only"
    assert ("the engine's words" in error.message) is (client_status == 400), "only a rejection shows the detail"


@pytest.mark.parametrize(
    ("hint_s", "gateway_s", "header"),
    [
        pytest.param(None, 1.0, "1", id="no hint from the backend gives one second"),
        pytest.param(0.2, 1.0, "1", id="a shorter hint is raised to one second"),
        pytest.param(7.0, 7.0, "7", id="a hint within bounds is kept"),
        pytest.param(3600.0, 30.0, "30", id="an hour is bounded to thirty seconds"),
        pytest.param(float("inf"), 1.0, "1", id="a non-finite hint is ignored"),
    ],
)
def test_the_retry_after_of_a_full_backend_is_the_gateway_s(
    hint_s: float | None, gateway_s: float, header: str
) -> None:
    assert gateway_retry_after(hint_s) == gateway_s
    for status in (429, 503):
        error = mapped_error(status, retry_after_s=hint_s)
        assert error.headers["retry-after"] == header
        assert error.headers["retry-after-ms"] == str(int(gateway_s * 1000))


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        pytest.param(CONTEXT_LENGTH, CONTEXT_LENGTH, id="vLLM's context-length message is kept whole"),
        pytest.param(
            "'max_tokens' is too large: 8000 (8000 > 4096 - 2778).",
            "'max_tokens' is too large: 8000 (8000 > 4096 - 2778).",
            id="field names and numbers are kept",
        ),
        pytest.param(
            "The model `meta-llama/Llama-3.1-8B-Instruct` does not exist.",
            "The model `meta-llama/Llama-3.1-8B-Instruct` does not exist.",
            id="a model name is not a path or a host",
        ),
        pytest.param(f"token {SECRET} rejected", "token [redacted] rejected", id="a known credential is redacted"),
        pytest.param(f"x{SECRET}y", "x[redacted]y", id="a known credential inside a word is redacted"),
        pytest.param("reached VLLM-0 too late", "reached [redacted] too late", id="a backend's host is redacted"),
        pytest.param("see http://a.b/c?key=1 now", "see [url] now", id="a URL is redacted"),
        pytest.param(
            "via gpu-3.ns.svc.cluster.local:8000 failed", "via [host] failed", id="a host name and port is redacted"
        ),
        pytest.param(
            "from 192.168.1.20:8000 and fe80::1ff:fe23:4567:890a", "from [ip] and [ip]", id="IPs are redacted"
        ),
        pytest.param("Authorization: Bearer abc.def", "Authorization: [redacted]", id="an authorization pair"),
        pytest.param("sent bearer abc.def", "sent bearer [redacted]", id="a bearer token"),
        pytest.param("x-api-key=abc, cookie: s=1", "x-api-key=[redacted], cookie: [redacted]", id="key pairs"),
        pytest.param("mail ops@corp.example.com", "mail [email]", id="an e-mail address"),
        pytest.param("open /home/vllm/.cache/x/config.json failed", "open [path] failed", id="an absolute path"),
        pytest.param(r"open C:\models\x.gguf failed", "open [path] failed", id="a Windows path"),
        pytest.param("key sk-" + "a" * 40, "key [redacted]", id="a long key-like string"),
        pytest.param("line one\r\nline two\tend\u202e", "line one line two end", id="one line, no control characters"),
        pytest.param(
            "1 validation error: {'loc': ('body', 'messages'), 'msg': 'Field required', 'input': {'prompt': 'hi'}}",
            "1 validation error: {'loc': ('body', 'messages'), 'msg': 'Field required'...",
            id="a pydantic echo of the input is cut",
        ),
        pytest.param(
            'bad body {"model": "m", "messages": [{"content": "my prompt"}]}',
            'bad body {"model": "m"...',
            id="an echoed request body is cut at its messages",
        ),
        pytest.param(
            "must be >= 0 (parameter=temperature, value=-1)",
            "must be >= 0 (parameter=temperature...",
            id="a rejected value is cut",
        ),
    ],
)
def test_the_excerpt_keeps_the_reason_and_redacts_what_is_secret(text: str, shown: str) -> None:
    assert excerpt(text, REDACTOR) == shown


def test_the_excerpt_is_bounded_and_never_ends_in_half_a_word() -> None:
    shown = excerpt("word " * 100, REDACTOR)
    assert len(shown) <= EXCERPT_CHARS + 3
    assert shown.endswith("word...")


def test_a_credential_straddling_the_scanned_head_is_not_half_shown() -> None:
    for pad in range(990, 1030):
        shown = excerpt("x " * (pad // 2) + SECRET + " tail", REDACTOR)
        assert "backend-" not in shown
        assert "secret" not in shown


@pytest.mark.parametrize(
    "text",
    ["a." * 2048, "a" * 4096, "a-" * 2048, "x@" * 2048, "1:" * 2048, "<" * 4096, "/a" * 2048, "input " * 700],
    ids=["dots", "letters", "hyphens", "ats", "colons", "angles", "slashes", "echo-markers"],
)
def test_a_hostile_body_costs_milliseconds_not_seconds(text: str) -> None:
    body = ("<html>" + text + "</html>").encode() * 16
    start = time.perf_counter()
    status_error(500, body, REDACTOR)
    assert time.perf_counter() - start < 0.5  # about 10 ms here; backtracking would take seconds


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        pytest.param(
            {"error": {"message": "too long", "type": "BadRequestError", "param": "max_tokens", "code": 400}},
            "too long",
            "max_tokens",
            id="OpenAI and vLLM nest the error",
        ),
        pytest.param(
            {"object": "error", "message": "too long", "type": "BadRequest", "param": None, "code": 400},
            "too long",
            None,
            id="SGLang and older vLLM are flat",
        ),
        pytest.param({"error": {"code": 400, "message": "too long"}}, "too long", None, id="llama.cpp nests"),
        pytest.param({"error": "too long"}, "too long", None, id="an error string"),
        pytest.param({"detail": "too long"}, "too long", None, id="FastAPI's own detail"),
        pytest.param(
            {"error": {"message": "too long", "param": "a b; DROP"}}, "too long", None, id="an odd param is dropped"
        ),
        pytest.param(
            {"error": {"message": "too long", "param": "gpu-3.corp.example"}},
            "too long",
            None,
            id="a param that is a host name is dropped",
        ),
    ],
)
def test_a_rejection_shows_the_message_of_any_engine_s_json_shape(
    body: dict[str, object], message: str, param: str | None
) -> None:
    error, fault = status_error(400, orjson.dumps(body), REDACTOR)
    assert error.message == f"The backend rejected the request: {message}"
    assert error.param == param
    assert (fault.status, fault.excerpt, fault.where) == (400, message, "status")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"<html><title>400 Bad Request</title><body>nginx at 10.9.8.7</body></html>", id="an HTML page"),
        pytest.param(b"Bad Request: prompt too long", id="plain text"),
        pytest.param(b'{"message": 42}', id="JSON without a message string"),
        pytest.param(b"", id="an empty body"),
    ],
)
def test_a_rejection_without_a_json_message_shows_only_the_gateway_s_sentence(body: bytes) -> None:
    error, fault = status_error(400, body, REDACTOR)
    assert error.message == "The backend rejected the request."
    assert b"<" not in error.body()
    assert b"nginx" not in error.body()
    assert b"prompt" not in error.body()
    assert "<" not in fault.excerpt, "the operator's excerpt has no markup"
    assert "10.9.8.7" not in fault.excerpt


def test_the_operator_s_excerpt_of_an_html_page_is_its_text() -> None:
    page = b"<html><head><title>502 Bad Gateway</title></head><body><center>nginx/1.25.3</center></body></html>"
    error, fault = status_error(502, page, REDACTOR)
    assert error.message == "The backend failed to process the request."
    assert fault.excerpt == "502 Bad Gateway nginx/1.25.3"


@pytest.mark.parametrize(
    ("event", "code", "shown"),
    [
        pytest.param(
            {"error": {"message": "bad schema", "type": "BadRequestError", "code": 400}},
            "upstream_rejected",
            True,
            id="a vLLM error event with code 400 is a rejection",
        ),
        pytest.param(
            {"error": {"message": "EngineCore died at /opt/x.py", "type": "InternalServerError", "code": 500}},
            "upstream_error",
            False,
            id="an engine failure hides its words",
        ),
        pytest.param(
            {"code": 400, "message": "bad schema", "type": "invalid_request_error"},
            "upstream_rejected",
            True,
            id="llama.cpp's error object",
        ),
        pytest.param(
            {"error": {"message": "bad schema", "type": "invalid_request_error", "code": "bad_schema"}},
            "upstream_rejected",
            True,
            id="a string code with an invalid-request type is a rejection",
        ),
        pytest.param({"error": {"message": "bad"}}, "upstream_error", False, id="an error without a code is a failure"),
        pytest.param(
            {"error": {"message": "busy", "code": 503}}, "upstream_unavailable", False, id="a 503 event is unavailable"
        ),
    ],
)
def test_an_error_event_becomes_the_gateway_s(event: dict[str, object], code: str, shown: bool) -> None:
    error, fault = event_error(event, REDACTOR)
    assert error.code == code
    assert ("bad schema" in error.message) is shown
    assert "/opt" not in fault.excerpt
    assert fault.where == "event"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(b"<html>captive portal</html>", "upstream_protocol_error", id="an HTML 200"),
        pytest.param(b'{"headers": {"x": "y"}}', "upstream_protocol_error", id="a JSON 200 that is no answer"),
        pytest.param(b"[1, 2]", "upstream_protocol_error", id="a JSON array"),
        pytest.param(
            orjson.dumps({"choices": [{"message": {"content": f"Bearer {SECRET}"}}]}),
            "upstream_protocol_error",
            id="an answer holding the gateway's credential",
        ),
        pytest.param(b'{"error": {"message": "m", "code": 400}}', "upstream_rejected", id="an error object in a 200"),
    ],
)
def test_a_200_that_is_no_answer_is_the_backend_s_failure(body: bytes, code: str) -> None:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        document = None
    problem = answer_error(body, document, REDACTOR)
    assert problem is not None
    error, fault = problem
    assert error.code == code
    assert fault.where == "answer"
    assert SECRET not in fault.excerpt


@pytest.mark.parametrize(
    "body",
    [{"choices": [{"message": {"content": "short and EMPTY"}}]}, {"data": [{"embedding": [0.1]}]}],
    ids=["a chat answer, even with a short credential's text in it", "an embeddings answer"],
)
def test_an_answer_passes(body: dict[str, object]) -> None:
    assert answer_error(orjson.dumps(body), body, REDACTOR) is None


def test_only_credentials_long_enough_to_be_secrets_are_searched_for_in_answers() -> None:
    assert REDACTOR.leaks(f"..{SECRET}..".encode())
    assert not REDACTOR.leaks(b"a short answer")
    assert excerpt("a short answer", REDACTOR) == "a [redacted] answer", "but every one is redacted from excerpts"
