"""Every error a client can meet, as the official SDK sees it, plus backend failures.

The first table drives the ``openai`` SDK (sync and async) into each error and checks the
exception class it raises, the status and the OpenAI error body. The rest covers what the
backend can do wrong (every error status, hostile answers that echo the gateway's credential
or are HTML pages, a refused connection) and the non-inference routes. The rule the backend
cases check is ``gateway/upstream/errors.py``'s: nothing of a failed backend's answer reaches
a client but a rejection's sanitised reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import (
    BACKEND_TOKEN,
    CHAT_MODEL,
    KEY_ACME,
    KEY_GLOBEX,
    MAX_BODY_BYTES,
    OTHER_MODEL,
    BackendServer,
    StartGateway,
    closed_port_url,
)
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import wait_until

Client = openai.OpenAI | openai.AsyncOpenAI


def chat(client: Client, content: str = "Hi", **fields: Any) -> Any:
    params: dict[str, Any] = {"model": CHAT_MODEL, "max_tokens": 8, **fields}
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **params)


@dataclass(frozen=True)
class SdkError:
    call: Callable[[Client], Any]
    exception: type[openai.APIStatusError]
    status: int
    code: str
    message: str
    backend_status: int = 200


SDK_ERRORS = [
    pytest.param(
        SdkError(lambda c: chat(c, "x" * 400), openai.BadRequestError, 400, "prompt_too_long", "accepts at most 64"),
        id="a prompt over the token estimate limit raises BadRequestError",
    ),
    pytest.param(
        SdkError(
            lambda c: c.chat.completions.create(
                model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}] * 5, max_tokens=8
            ),
            openai.BadRequestError,
            400,
            "too_many_messages",
            "the limit is 4",
        ),
        id="too many messages raise BadRequestError",
    ),
    pytest.param(
        SdkError(lambda c: chat(c, max_tokens=33), openai.BadRequestError, 400, "max_tokens_too_large", "at most 32"),
        id="max_tokens over the cap raises BadRequestError",
    ),
    pytest.param(
        SdkError(lambda c: chat(c, n=3), openai.BadRequestError, 400, "n_too_large", "the limit is 2"),
        id="n over the cap raises BadRequestError",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c, extra_body={"stream_options": "yes"}),
            openai.BadRequestError,
            400,
            "invalid_field",
            "'stream_options' must be an object",
        ),
        id="a field of the wrong type raises BadRequestError",
    ),
    pytest.param(
        SdkError(
            lambda c: c.completions.create(model=CHAT_MODEL, prompt="x" * 400),
            openai.BadRequestError,
            400,
            "prompt_too_long",
            "at most 64",
        ),
        id="a long completions prompt raises BadRequestError",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c.with_options(api_key="not-a-key")),
            openai.AuthenticationError,
            401,
            "invalid_api_key",
            "Incorrect API key",
        ),
        id="an unknown key raises AuthenticationError",
    ),
    pytest.param(
        SdkError(
            lambda c: c.with_options(api_key="not-a-key").models.list(),
            openai.AuthenticationError,
            401,
            "invalid_api_key",
            "Incorrect API key",
        ),
        id="an unknown key listing models raises AuthenticationError",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c.with_options(api_key=KEY_GLOBEX), model=OTHER_MODEL),
            openai.NotFoundError,
            404,
            "model_not_found",
            "does not exist or you do not have access to it",
        ),
        id="a model the tenant may not use raises NotFoundError, as an unknown one",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c, model="no/such-model"), openai.NotFoundError, 404, "model_not_found", "does not exist"
        ),
        id="an unknown model raises NotFoundError",
    ),
    pytest.param(
        SdkError(
            lambda c: c.embeddings.create(model="no/such-model", input="Hi"),
            openai.NotFoundError,
            404,
            "model_not_found",
            "`no/such-model` does not exist",
        ),
        id="an unknown embeddings model raises NotFoundError",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c, extra_body={"user": "x" * MAX_BODY_BYTES}),
            openai.APIStatusError,
            413,
            "request_too_large",
            f"the limit is {MAX_BODY_BYTES} bytes",
        ),
        id="a body over the byte limit raises APIStatusError with status 413",
    ),
    pytest.param(
        SdkError(
            lambda c: c.get("/chat/completions", cast_to=object),
            openai.APIStatusError,
            405,
            "method_not_allowed",
            "accepts POST only",
        ),
        id="a GET of an inference route raises APIStatusError with status 405",
    ),
    pytest.param(
        SdkError(
            lambda c: c.post("/no/such/route", cast_to=object, body={}),
            openai.NotFoundError,
            404,
            "not_found",
            "No route for POST /v1/no/such/route",
        ),
        id="an unknown route raises NotFoundError",
    ),
    pytest.param(
        SdkError(lambda c: chat(c), openai.InternalServerError, 502, "upstream_error", "failed to process", 500),
        id="a backend 500 raises InternalServerError with status 502",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c, stream=True),
            openai.InternalServerError,
            503,
            "upstream_unavailable",
            "unavailable; retry after 1s",
            503,
        ),
        id="a backend 503 to a stream raises InternalServerError before any chunk",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c), openai.BadRequestError, 400, "upstream_rejected", "rejected the request: boom", 400
        ),
        id="a backend 400 is a BadRequestError with the gateway's sentence and the backend's reason",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c), openai.InternalServerError, 502, "upstream_auth_failed", "not of your request", 401
        ),
        id="a backend 401 is never an AuthenticationError for a client with a valid key",
    ),
]


async def _call(case: SdkError, sdk: Client) -> None:
    result = case.call(sdk)  # a coroutine when the client is async
    if inspect.isawaitable(result):
        await result


@pytest.mark.parametrize("case", SDK_ERRORS)
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_each_error_raises_the_sdk_exception_of_its_status(
    client: openai.OpenAI,
    async_client: openai.AsyncOpenAI,
    backend: FakeBackend,
    flavour: str,
    case: SdkError,
) -> None:
    backend.status = case.backend_status
    sdk: Client = client if flavour == "sync" else async_client
    with pytest.raises(openai.APIStatusError) as caught:
        await _call(case, sdk)
    error = caught.value
    assert type(error) is case.exception
    assert error.status_code == case.status
    assert isinstance(error.body, dict)
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.code == case.code
    assert case.message in error.body["message"]


# --- backend failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend_status", "status", "code"),
    [
        pytest.param(500, 502, "upstream_error", id="a backend 500 becomes a 502"),
        pytest.param(502, 502, "upstream_error", id="a backend 502 becomes a 502 of the gateway"),
        pytest.param(503, 503, "upstream_unavailable", id="a backend 503 becomes a 503 of the gateway"),
        pytest.param(504, 504, "upstream_timeout", id="a backend 504 becomes a 504 of the gateway"),
        pytest.param(429, 503, "upstream_overloaded", id="a backend 429 after the retries is an overloaded 503"),
        pytest.param(401, 502, "upstream_auth_failed", id="a backend 401 is the gateway's credential, a 502"),
        pytest.param(403, 502, "upstream_auth_failed", id="a backend 403 is the gateway's credential, a 502"),
        pytest.param(407, 502, "upstream_auth_failed", id="a backend 407 is the gateway's credential, a 502"),
        pytest.param(404, 502, "upstream_misconfigured", id="a backend 404 is a misconfigured backend, a 502"),
        pytest.param(405, 502, "upstream_misconfigured", id="a backend 405 is a misconfigured backend, a 502"),
        pytest.param(400, 400, "upstream_rejected", id="a backend 400 is the client's to fix and stays a 400"),
        pytest.param(413, 400, "upstream_rejected", id="a backend 413 is a rejection, a 400"),
        pytest.param(422, 400, "upstream_rejected", id="a backend 422 is a rejection, a 400"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_backend_error_status_is_mapped_to_the_gateway_s_own_error(
    http: httpx.Client, backend: FakeBackend, backend_status: int, status: int, code: str, stream: bool
) -> None:
    backend.status = backend_status
    response = http.post(
        "/v1/chat/completions",
        json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": stream},
    )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert ("boom" in error["message"]) is (status == 400), "only a rejection carries the backend's words"
    assert str(backend_status) not in response.text, "the upstream status is for the logs only"
    assert "Traceback" not in response.text
    if status == 503:
        assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("1", "1000")


@pytest.mark.parametrize(
    ("backend_status", "backend_hint", "gateway_hint"),
    [
        pytest.param(429, "3600", "30", id="a backend 429 asking for an hour gets the gateway's bound"),
        pytest.param(503, "2", "2", id="a backend 503's hint within bounds is the gateway's"),
        pytest.param(503, "Wed, 21 Oct 2015 07:28:00 GMT", "1", id="a date in the past gives the gateway's floor"),
    ],
)
def test_the_retry_after_a_client_gets_is_the_gateway_s_own(
    http: httpx.Client, backend: FakeBackend, backend_status: int, backend_hint: str, gateway_hint: str
) -> None:
    backend.status = backend_status
    backend.error_headers = [(b"content-type", b"application/json"), (b"retry-after", backend_hint.encode())]
    response = http.post(
        "/v1/chat/completions", json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert response.status_code == 503
    assert response.headers.get_list("retry-after") == [gateway_hint]
    assert response.headers["retry-after-ms"] == str(int(gateway_hint) * 1000)


# --- hostile backends: nothing of theirs reaches a client ---------------------------------------

ECHO_JSON = b'{"error": {"message": "Bad request {echo}", "type": "BadRequestError", "param": null, "code": 400}}'
ECHO_PAGE = b"<html><head><title>Error</title></head><body><h1>proxy-7.corp.example</h1><pre>{echo}</pre></body></html>"
HTML = [(b"content-type", b"text/html")]


def role_event() -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": CHAT_MODEL}
    return b"data: " + orjson.dumps({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + b"\n\n"


@dataclass(frozen=True)
class Hostile:
    status: int = 200
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] | None = None
    script: list[bytes] | None = None
    stream: bool = False
    client_status: int = 502
    fails: bool = True  # a dropped comment or non-JSON event is no failure of the stream


HOSTILE = [
    pytest.param(Hostile(400, ECHO_JSON, client_status=400), id="a 400 whose JSON message echoes the request"),
    pytest.param(Hostile(401, ECHO_JSON.replace(b"400", b"401")), id="a 401 whose JSON echoes the request"),
    pytest.param(Hostile(500, ECHO_PAGE, HTML), id="a 500 HTML page echoing the request"),
    pytest.param(Hostile(400, ECHO_PAGE, HTML, client_status=400), id="a 400 HTML page echoing the request"),
    pytest.param(Hostile(503, ECHO_PAGE, HTML, client_status=503), id="a 503 HTML page echoing the request"),
    pytest.param(Hostile(200, ECHO_PAGE, HTML), id="a 200 HTML page echoing the request"),
    pytest.param(Hostile(200, b'{"echo": "{echo}"}'), id="a 200 JSON echo of the request"),
    pytest.param(
        Hostile(200, b'{"choices": [{"message": {"content": "{echo}"}}]}'), id="a 200 answer holding the echo"
    ),
    pytest.param(
        Hostile(
            script=[role_event(), b'data: {"error": {"message": "Bad {echo}", "code": 400}}\n\n', b"data: [DONE]\n\n"],
            stream=True,
            client_status=200,
        ),
        id="an error event echoing the request",
    ),
    pytest.param(
        Hostile(script=[role_event(), b"error: {echo}\n\n"], stream=True, client_status=200),
        id="a llama.cpp error field echoing the request",
    ),
    pytest.param(
        Hostile(
            script=[b": {echo}\n\n", role_event(), b"data: [DONE]\n\n"], stream=True, client_status=200, fails=False
        ),
        id="a comment echoing the request",
    ),
    pytest.param(
        Hostile(
            script=[role_event(), b'data: {"choices": [{"index": 0, "delta": {"content": "{echo}"}}]}\n\n'],
            stream=True,
            client_status=200,
        ),
        id="a chunk echoing the request",
    ),
    pytest.param(
        Hostile(
            script=[role_event(), b"data: <html>{echo}</html>\n\n", b"data: [DONE]\n\n"],
            stream=True,
            client_status=200,
            fails=False,
        ),
        id="a non-JSON data event echoing the request",
    ),
    pytest.param(Hostile(script=[ECHO_PAGE], stream=True, client_status=200), id="an HTML page as a stream"),
]


@pytest.mark.parametrize("case", HOSTILE)
def test_no_client_visible_byte_holds_the_backend_credential_host_or_page(
    http: httpx.Client, backend: FakeBackend, backend_server: BackendServer, case: Hostile
) -> None:
    backend.status = case.status
    backend.error_body = case.body
    backend.answer_body = case.body if case.status == 200 and not case.stream else None
    backend.stream_script = case.script
    backend.error_headers = case.headers or [(b"content-type", b"application/json")]
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": case.stream}
    response = http.post("/v1/chat/completions", json=body)
    assert backend.received[-1].headers["authorization"] == f"Bearer {BACKEND_TOKEN}", "the echo held the credential"
    assert response.status_code == case.client_status
    visible = b"\n".join(
        [response.reason_phrase.encode(), *(k + b": " + v for k, v in response.headers.raw), response.content]
    )
    backend_host = backend_server.url.removeprefix("http://").encode()
    for secret in (BACKEND_TOKEN.encode(), backend_host, backend_host.split(b":")[1], b"<html", b"proxy-7", b"Bearer"):
        assert secret not in visible, f"{secret!r} reached the client"
    if case.stream:
        assert response.text.endswith("data: [DONE]\n\n")
        assert ('"error"' in response.text) is case.fails, "a failure is explicit"
    else:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_failure_is_logged_with_its_status_a_sanitised_excerpt_and_both_ids(
    http: httpx.Client, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    backend.status = 400
    backend.error_body = ECHO_JSON
    with caplog.at_level(logging.WARNING, logger="gateway.upstream.errors"):
        response = http.post(
            "/v1/chat/completions",
            json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "the launch code is 0000"}]},
            headers={"x-request-id": "client-req-77"},
        )
        wait_until(lambda: any("client-req-77" in r.getMessage() for r in caplog.records), what="the warning")
    assert response.status_code == 400
    (line,) = [r.getMessage() for r in caplog.records if "client-req-77" in r.getMessage()]
    engine_id = backend.received[-1].headers["x-request-id"]
    assert engine_id.startswith("gw-")
    assert engine_id in line
    assert "status 400" in line
    assert "Bad request headers=" in line, "the excerpt tells the operator what the backend said"
    for secret in (BACKEND_TOKEN, "launch code", "127.0.0.1"):
        assert secret not in line, f"{secret!r} in the log"


def test_a_refused_connection_is_a_502_and_marks_the_backend_unhealthy(start_gateway: StartGateway) -> None:
    text = session_policy(closed_port_url())
    with start_gateway(text, health_checks=False) as url:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0)
        with sdk, pytest.raises(openai.InternalServerError) as caught:
            chat(sdk)
        assert caught.value.status_code == 502
        assert caught.value.code == "upstream_connect_error"
        assert "Backend 'fake' failed" in caught.value.message
        # The failure marked the only backend unhealthy: the next request is refused at once.
        response = httpx.post(
            url + "/v1/chat/completions",
            json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"authorization": f"Bearer {KEY_ACME}"},
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_backend"
        assert response.headers["retry-after"] == "1"


def test_a_refused_connection_on_a_stream_is_a_502_before_any_event(start_gateway: StartGateway) -> None:
    with start_gateway(session_policy(closed_port_url()), health_checks=False) as url:
        response = httpx.post(
            url + "/v1/chat/completions",
            json={"model": CHAT_MODEL, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"authorization": f"Bearer {KEY_ACME}"},
        )
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("application/json")


# --- routes and methods ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_wrong_method_on_an_inference_route_is_a_405(http: httpx.Client, method: str, path: str) -> None:
    response = http.request(method, path)
    assert response.status_code == 405
    assert response.json()["error"] == {
        "message": f"{path} accepts POST only.",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/", id="the root is not a route"),
        pytest.param("POST", "/v1/chat/completion", id="a misspelt route is a 404"),
        pytest.param("GET", "/v1/models/extra/path", id="a path below the model list is a 404"),
        pytest.param("POST", "/v2/chat/completions", id="another API version is a 404"),
    ],
)
def test_an_unknown_path_is_a_404_in_openai_shape(http: httpx.Client, method: str, path: str) -> None:
    response = http.request(method, path)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"] == {
        "message": f"No route for {method} {path}.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
