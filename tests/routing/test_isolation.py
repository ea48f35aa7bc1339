"""Backend isolation: the gateway sets cache_salt per tenant scope, overwriting the client's."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.policy.model import BackendKind, UnsaltedMode
from gateway.routing.isolation import CacheSalter, isolation_fields
from gateway.service import parse_policy
from tests.conftest import KEY_ACME, KEY_GLOBEX, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy

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
    with start_gateway(session_policy(backend_server.url), health_checks=False) as url:
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


ACME_SALT = expected_salt("tenant:acme")
DEDICATED = {"tenants": ["acme"]}


@pytest.mark.parametrize(
    ("kind", "unsalted", "client_fields", "forwarded"),
    [
        pytest.param("sglang", "shared", {}, {"cache_salt": ACME_SALT}, id="sglang backends get the salt as vllm's do"),
        pytest.param(
            "sglang",
            "shared",
            {"cache_salt": "globex-guess"},
            {"cache_salt": ACME_SALT},
            id="an sglang client's own cache_salt is overwritten",
        ),
        pytest.param("sim", "shared", {}, {"cache_salt": ACME_SALT}, id="simulated engines get the salt"),
        pytest.param(
            "vllm",
            "no_prompt_cache",
            {"cache_prompt": True},
            {"cache_salt": ACME_SALT, "cache_prompt": None},
            id="salted backends are left their cache under no_prompt_cache, the client's cache_prompt stripped",
        ),
        pytest.param(
            "llamacpp",
            "no_prompt_cache",
            {"cache_prompt": True},
            {"cache_salt": None, "cache_prompt": False},
            id="llamacpp backends get cache_prompt false under no_prompt_cache, the client's true overwritten",
        ),
        pytest.param(
            "llamacpp",
            "no_prompt_cache",
            {},
            {"cache_salt": None, "cache_prompt": False},
            id="llamacpp backends get cache_prompt false when the client says nothing",
        ),
        pytest.param(
            "llamacpp",
            "shared",
            {"cache_prompt": True},
            {"cache_salt": None, "cache_prompt": None},
            id="llamacpp backends under shared get no cache_prompt: it is the gateway's field",
        ),
        pytest.param(
            "llamacpp",
            "dedicated",
            {},
            {"cache_salt": None, "cache_prompt": None},
            id="a dedicated llamacpp backend keeps its cache, since one scope reaches it",
        ),
        pytest.param(
            "openai", "shared", {}, {"cache_salt": None, "cache_prompt": None}, id="openai backends get neither field"
        ),
    ],
)
def test_each_backend_kind_gets_the_isolation_fields_of_the_policys_mode(
    start_gateway: StartGateway,
    backend: FakeBackend,
    backend_server: BackendServer,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    unsalted: str,
    client_fields: dict[str, object],
    forwarded: dict[str, object],
) -> None:
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    served = DEDICATED if unsalted == "dedicated" else {}
    text = session_policy(
        backend_server.url, backends={"fake": {"kind": kind, **served}}, cache_isolation={"unsalted": unsalted}
    )
    with (
        start_gateway(text, health_checks=False) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as client,
    ):
        client.chat.completions.create(
            model="test/chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=client_fields
        )
    (received,) = backend.received
    assert {field: received.body.get(field) for field in forwarded} == forwarded


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


SALT = {"cache_salt": ACME_SALT}
NO_REUSE = {"cache_prompt": False}


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        pytest.param(kind, {mode: fields[i] for i, mode in enumerate(UnsaltedMode)}, id=f"{kind.value}: {label}")
        for kind, fields, label in [
            (BackendKind.VLLM, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.SGLANG, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.SIM, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.LLAMACPP, ({}, NO_REUSE, {}), "no prompt reuse under no_prompt_cache only"),
            (BackendKind.OPENAI, ({}, {}, {}), "nothing to set in any mode"),
        ]
    ],
)
def test_isolation_fields_by_kind_and_mode(kind: BackendKind, fields: dict[UnsaltedMode, dict[str, object]]) -> None:
    acme = parse_policy(session_policy(), "t.yaml").policy.tenants[0]
    salter = CacheSalter(SECRET.encode())
    assert {mode: dict(isolation_fields(kind, mode, salter, acme)) for mode in UnsaltedMode} == fields
