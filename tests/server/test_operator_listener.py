"""The operator listener: /metrics and /admin/* answer only there, the probes on both listeners.

``/metrics`` shows per-tenant cost and the policy's model names, and ``/admin/*`` changes the
policy: they must not be reachable by whoever reaches the API port. Kubernetes probes hit the
pod's API port, so ``/healthz`` and ``/readyz`` stay there too.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.settings import DEFAULT_ADMIN_PORT, Settings
from tests.conftest import CHAT_MODEL, KEY_ACME, metric
from tests.servers import admin_url


@pytest.mark.parametrize(
    ("method", "path", "on_api", "on_admin"),
    [
        pytest.param("GET", "/metrics", 404, 200, id="metrics answer only on the operator listener"),
        # 403: the test policy lists no admin key (gateway/server/admin.py); tests/server/test_lifecycle.py has one.
        pytest.param("GET", "/admin/policy", 404, 403, id="the policy status answers only there"),
        pytest.param("POST", "/admin/reload", 404, 403, id="a reload answers only there"),
        pytest.param("GET", "/healthz", 200, 200, id="liveness answers on both"),
        pytest.param("GET", "/readyz", 200, 200, id="readiness answers on both"),
        pytest.param("GET", "/v1/models", 401, 404, id="the model list answers only on the API listener"),
        pytest.param("POST", "/v1/chat/completions", 401, 404, id="inference answers only on the API listener"),
    ],
)
def test_each_endpoint_answers_on_its_listener(
    gateway_url: str, method: str, path: str, on_api: int, on_admin: int
) -> None:
    api = httpx.request(method, gateway_url + path)
    admin = httpx.request(method, admin_url(gateway_url) + path)
    assert (api.status_code, admin.status_code) == (on_api, on_admin)
    for refused in (r for r in (api, admin) if r.status_code == 404):
        assert refused.json()["error"]["code"] == "not_found"
        assert "x-request-id" in refused.headers


def chat(gateway_url: str) -> httpx.Response:
    return httpx.post(
        gateway_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY_ACME}"},
        json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )


def test_the_api_listener_never_shows_tenants_costs_or_model_names(gateway_url: str) -> None:
    assert chat(gateway_url).status_code == 200
    page = httpx.get(gateway_url + "/metrics")
    assert page.status_code == 404
    assert CHAT_MODEL not in page.text
    assert "acme" not in page.text
    assert CHAT_MODEL in httpx.get(admin_url(gateway_url) + "/metrics").text


def test_each_listener_counts_its_own_connections(gateway_url: str) -> None:
    with httpx.Client() as api:
        assert api.get(gateway_url + "/healthz").status_code == 200
        # The pooled API connection stays open while the operator listener is scraped.
        assert metric(gateway_url, "gateway_connections_open", listener="api") >= 1
        assert metric(gateway_url, "gateway_connections_open", listener="admin") >= 1


def test_the_backend_connections_kept_alive_are_counted(gateway_url: str) -> None:
    assert chat(gateway_url).status_code == 200
    # The answer was read whole: its connection stays in the pool (5 s), counted until then.
    assert metric(gateway_url, "gateway_upstream_connections_open") >= 1


def test_the_operator_listener_is_on_loopback_by_default() -> None:
    settings = Settings(policy_path="p.yaml")
    assert (settings.admin_host, settings.admin_port) == ("127.0.0.1", DEFAULT_ADMIN_PORT)
