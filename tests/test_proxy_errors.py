"""Every error a client can meet, as the official SDK sees it, plus backend failures.

The first table drives the ``openai`` SDK (sync and async) into each error and checks the
exception class it raises, the status and the OpenAI error body. The rest covers what the
backend can do wrong (a 5xx, a 4xx, a refused connection) and the non-inference routes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import (
    CHAT_MODEL,
    KEY_ACME,
    KEY_GLOBEX,
    MAX_BODY_BYTES,
    OTHER_MODEL,
    StartGateway,
    closed_port_url,
    policy_text,
)
from tests.fake_backend import FakeBackend

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
            openai.PermissionDeniedError,
            403,
            "model_not_allowed",
            "not allowed to use model 'test/other'",
        ),
        id="a model the tenant may not use raises PermissionDeniedError",
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
            "'no/such-model' does not exist",
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
        SdkError(lambda c: chat(c), openai.InternalServerError, 502, "upstream_error", "answered 500", 500),
        id="a backend 500 raises InternalServerError with status 502",
    ),
    pytest.param(
        SdkError(
            lambda c: chat(c, stream=True), openai.InternalServerError, 502, "upstream_error", "answered 503", 503
        ),
        id="a backend 503 to a stream raises InternalServerError before any chunk",
    ),
    pytest.param(
        SdkError(lambda c: chat(c), openai.BadRequestError, 400, "upstream_rejected", "boom", 400),
        id="a backend 400 is passed on as BadRequestError with the backend's message",
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
        pytest.param(503, 502, "upstream_error", id="a backend 503 becomes a 502"),
        pytest.param(404, 502, "upstream_error", id="a backend 404 becomes a 502 (the gateway knows the model)"),
        pytest.param(400, 400, "upstream_rejected", id="a backend 400 is the client's fault and stays a 400"),
        pytest.param(422, 422, "upstream_rejected", id="a backend 422 stays a 422"),
    ],
)
def test_a_backend_error_status_is_mapped_for_the_client(
    http: httpx.Client, backend: FakeBackend, backend_status: int, status: int, code: str
) -> None:
    backend.status = backend_status
    response = http.post(
        "/v1/chat/completions", json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert "boom" in error["message"]
    assert "Traceback" not in response.text


def test_a_refused_connection_is_a_502_and_marks_the_backend_unhealthy(start_gateway: StartGateway) -> None:
    text = policy_text(closed_port_url())
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
    with start_gateway(policy_text(closed_port_url()), health_checks=False) as url:
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
