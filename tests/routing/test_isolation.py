"""Backend isolation: the gateway sets cache_salt per tenant scope, overwriting the client's."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator

import httpx
import pytest

from gateway.routing.isolation import CacheSalter
from tests.conftest import KEY_ACME, KEY_GLOBEX, BackendServer, StartGateway, policy_text
from tests.fake_backend import FakeBackend

SECRET = "test-salt-secret"


def expected_salt(scope: str) -> str:
    return hmac.new(SECRET.encode(), scope.encode(), hashlib.sha256).hexdigest()[:32]


def send(url: str, key: str, **fields: object) -> None:
    body = {"model": "test/chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


@pytest.fixture
def salted_gateway(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    with start_gateway(policy_text(backend_server.url), health_checks=False) as url:
        yield url


@pytest.mark.parametrize(
    ("key", "scope", "client_salt"),
    [
        pytest.param(KEY_ACME, "tenant:acme", None, id="a tenant's requests carry its salt"),
        pytest.param(KEY_GLOBEX, "tenant:globex", None, id="another tenant's carry another salt"),
        pytest.param(KEY_ACME, "tenant:acme", "globex-guess", id="a client's own cache_salt is overwritten"),
    ],
)
def test_vllm_backends_get_the_hmac_of_the_tenants_scope_as_cache_salt(
    salted_gateway: str, backend: FakeBackend, key: str, scope: str, client_salt: str | None
) -> None:
    extra = {"cache_salt": client_salt} if client_salt else {}
    send(salted_gateway, key, **extra)
    assert backend.received[-1].body["cache_salt"] == expected_salt(scope)


def test_backends_that_ignore_cache_salt_do_not_get_one(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> None:
    text = policy_text(backend_server.url).replace("kind: vllm", "kind: openai")
    with start_gateway(text, health_checks=False) as url:
        send(url, KEY_ACME)
    assert "cache_salt" not in backend.received[-1].body


def test_without_a_secret_each_process_draws_its_own_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.routing.isolation"):
        one, two = CacheSalter.from_env("NOPE", environ={}), CacheSalter.from_env("NOPE", environ={})
    assert one.salt("tenant:a") != two.salt("tenant:a")
    assert not one.shared
    assert "replicas will not share" in caplog.text


def test_a_shared_secret_gives_every_replica_the_same_salts() -> None:
    one = CacheSalter.from_env("S", environ={"S": SECRET})
    two = CacheSalter.from_env("S", environ={"S": SECRET})
    assert one.salt("tenant:a") == two.salt("tenant:a") == expected_salt("tenant:a")
    assert one.salt("tenant:a") != one.salt("tenant:b")
