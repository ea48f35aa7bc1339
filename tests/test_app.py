"""How the app routes what it is sent: raw paths, no redirects, OpenAI-shaped 405s and starts, nosniff.

Each rule is a way past a filter in front of the gateway or a way to make it say something it
should not: an escaped path that decodes to an operator endpoint, a redirect that echoes a forged
``Host``, an error a client cannot parse.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from gateway.app import GatewayApp
from gateway.settings import Settings
from tests.conftest import CHAT_MODEL, KEY_ACME
from tests.policy_builder import session_policy
from tests.servers import admin_url


def raw_request(url: str, head: str) -> bytes:
    """Send ``head`` (request line and headers) as written, return the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("listener", "path"),
    [
        pytest.param("operator", "/admin%2Fpolicy", id="an escaped slash never reaches the admin endpoint"),
        pytest.param("operator", "/%6detrics", id="an escaped letter never reaches the metrics"),
        pytest.param("api", "/v1%2Fchat%2Fcompletions", id="an escaped inference path is not the inference path"),
        pytest.param("api", "/%76%31/models", id="an escaped model list is not the model list"),
    ],
)
def test_an_escaped_path_is_a_404_whatever_it_decodes_to(gateway_url: str, listener: str, path: str) -> None:
    base = admin_url(gateway_url) if listener == "operator" else gateway_url
    answer = raw_request(
        base, f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_ACME}\r\nConnection: close\r\n"
    )
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 404 Not Found"
    assert b'"code":"not_found"' in rest


@pytest.mark.parametrize("path", ["/metrics/", "/healthz/", "/admin/policy/"])
def test_a_trailing_slash_is_a_404_never_a_redirect_to_a_forged_host(gateway_url: str, path: str) -> None:
    answer = httpx.get(admin_url(gateway_url) + path, headers={"host": "evil.example"}, follow_redirects=False)
    assert answer.status_code == 404
    assert "location" not in answer.headers
    assert answer.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("listener", "method", "path", "allowed"),
    [
        pytest.param("operator", "GET", "/admin/reload", "POST", id="GET on the reload"),
        pytest.param("operator", "POST", "/metrics", "GET", id="POST on the metrics"),
        pytest.param("api", "GET", "/v1/chat/completions", "POST", id="GET on chat completions"),
        pytest.param("api", "DELETE", "/v1/models", "GET", id="DELETE on the model list"),
    ],
)
def test_a_wrong_method_is_an_openai_shaped_405_naming_the_allowed_one(
    gateway_url: str, listener: str, method: str, path: str, allowed: str
) -> None:
    base = admin_url(gateway_url) if listener == "operator" else gateway_url
    answer = httpx.request(method, base + path, headers={"authorization": f"Bearer {KEY_ACME}"})
    assert answer.status_code == 405
    assert answer.json()["error"]["code"] == "method_not_allowed"
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert allowed in answer.headers["allow"]


@pytest.mark.parametrize(
    ("listener", "method", "path"),
    [
        pytest.param("api", "GET", "/healthz", id="the liveness probe"),
        pytest.param("api", "GET", "/v1/models", id="the model list"),
        pytest.param("api", "GET", "/nowhere", id="a 404"),
        pytest.param("api", "POST", "/v1/chat/completions", id="an inference answer"),
        pytest.param("operator", "GET", "/metrics", id="the metrics"),
    ],
)
def test_every_answer_says_nosniff(gateway_url: str, listener: str, method: str, path: str) -> None:
    base = admin_url(gateway_url) if listener == "operator" else gateway_url
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.request(
        method, base + path, headers={"authorization": f"Bearer {KEY_ACME}"}, json=body if method == "POST" else None
    )
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["x-request-id"]


async def test_before_start_up_the_model_list_answers_an_openai_shaped_503(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy())
    app = GatewayApp(Settings(policy_path=str(policy)))  # its lifespan never ran
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        answer = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY_ACME}"})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "starting"
    assert answer.headers["retry-after"] == "1"
