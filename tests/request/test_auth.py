"""Tenants and keys: 401 without a known key, 404 for a model unknown or not the tenant's, credentials kept apart.

The client's key identifies its tenant at the gateway and stops there: the backend sees
only its own credential, read from the environment variable the policy names.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import BACKEND_TOKEN, CHAT_MODEL, KEY_ACME, KEY_GLOBEX, OTHER_MODEL, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import OMIT, session_policy

CHAT = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

UNAUTHENTICATED = [
    pytest.param({}, "missing_api_key", "Missing API key", id="no Authorization header is a 401"),
    pytest.param({"authorization": ""}, "missing_api_key", "Missing API key", id="an empty Authorization is a 401"),
    pytest.param(
        {"authorization": "Bearer not-a-key"}, "invalid_api_key", "Incorrect API key", id="an unknown key is a 401"
    ),
    pytest.param(
        {"authorization": f"Basic {KEY_ACME}"},
        "invalid_api_key",
        "expected 'Bearer <key>'",
        id="a Basic scheme is a 401",
    ),
    pytest.param({"authorization": "Bearer"}, "invalid_api_key", "Bearer <key>", id="a Bearer without key is a 401"),
    pytest.param(
        {"authorization": f"Bearer {KEY_ACME}x"},
        "invalid_api_key",
        "Incorrect",
        id="a key with one extra char is a 401",
    ),
]


@pytest.mark.parametrize(("headers", "code", "message"), UNAUTHENTICATED)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/v1/models")],
)
def test_a_request_without_a_known_key_is_a_401(
    gateway_url: str, backend: FakeBackend, method: str, path: str, headers: dict[str, str], code: str, message: str
) -> None:
    response = httpx.request(method, gateway_url + path, json=CHAT if method == "POST" else None, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": "authentication_error", "param": None, "code": code}
    assert message in error["message"]
    assert backend.received == []


def test_the_key_is_checked_before_the_body_is_judged(gateway_url: str, backend: FakeBackend) -> None:
    response = httpx.post(gateway_url + "/v1/chat/completions", content=b"{not json", headers={"authorization": "x"})
    assert response.status_code == 401


def test_a_model_the_tenant_may_not_use_is_a_404_as_if_it_did_not_exist(gateway_url: str, backend: FakeBackend) -> None:
    response = httpx.post(
        gateway_url + "/v1/chat/completions",
        json={**CHAT, "model": OTHER_MODEL},
        headers={"authorization": f"Bearer {KEY_GLOBEX}"},
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error == {
        "message": "The model `test/other` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert backend.received == []


def test_an_unknown_model_is_a_404(http: httpx.Client, backend: FakeBackend) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, "model": "no/such-model"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `no/such-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert backend.received == []


def test_an_unknown_model_is_a_404_even_for_a_tenant_with_a_model_list(gateway_url: str) -> None:
    response = httpx.post(
        gateway_url + "/v1/chat/completions",
        json={**CHAT, "model": "no/such-model"},
        headers={"authorization": f"Bearer {KEY_GLOBEX}"},
    )
    assert response.status_code == 404


FORWARDED = [
    pytest.param("/v1/chat/completions", CHAT, id="a chat request"),
    pytest.param("/v1/chat/completions", {**CHAT, "stream": True}, id="a streamed chat request"),
    pytest.param("/v1/completions", {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 4}, id="a completion"),
    pytest.param("/v1/embeddings", {"model": CHAT_MODEL, "input": "Hi"}, id="an embeddings request"),
]


@pytest.mark.parametrize(("path", "body"), FORWARDED)
def test_the_backend_gets_its_own_credential_never_the_clients(
    gateway_url: str, backend: FakeBackend, path: str, body: dict[str, Any]
) -> None:
    client_headers = {
        "authorization": f"Bearer {KEY_ACME}",
        "api-key": KEY_ACME,
        "x-api-key": KEY_ACME,
        "cookie": f"session={KEY_ACME}",
    }
    response = httpx.post(gateway_url + path, json=body, headers=client_headers)
    assert response.status_code == 200, response.text
    received = backend.received[-1]
    assert received.headers["authorization"] == f"Bearer {BACKEND_TOKEN}"
    assert not any(KEY_ACME in value for value in received.headers.values()), received.headers


def test_a_backend_without_a_credential_gets_no_authorization_header(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    text = session_policy(backend_server.url, backends={"fake": {"credential_env": OMIT}})
    with start_gateway(text) as url:
        response = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY_ACME}"})
    assert response.status_code == 200, response.text
    assert "authorization" not in backend.received[-1].headers


def test_the_sdks_key_is_not_forwarded_either(client: openai.OpenAI, backend: FakeBackend) -> None:
    client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert backend.received[-1].headers["authorization"] == f"Bearer {BACKEND_TOKEN}"


MODEL_LISTS = [
    pytest.param(KEY_ACME, [CHAT_MODEL, OTHER_MODEL], id="acme may use every model and sees both"),
    pytest.param(KEY_GLOBEX, [CHAT_MODEL], id="globex sees only the model it may use"),
]


@pytest.mark.parametrize(("key", "models"), MODEL_LISTS)
def test_the_model_list_shows_only_the_tenants_models(gateway_url: str, key: str, models: list[str]) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0) as sdk:
        listed = sdk.models.list()
    assert sorted(model.id for model in listed) == models
    assert all(model.object == "model" for model in listed)
