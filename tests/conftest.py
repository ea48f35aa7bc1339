"""Fixtures: a fake backend and the gateway in front of it, as real servers on loopback ports.

The fake backend (``tests/fake_backend.py``) and the main gateway are started once per
session; the ``backend`` fixture resets the backend's knobs and its record of received
requests before each test, so tests stay independent while sharing the servers. Tests that
need a gateway with another policy (clamping, a dead backend, ...) start one with
``start_gateway``, which takes the policy text and returns a context manager.

Keys: ``key-acme`` (tenant acme, every model), ``key-globex`` (tenant globex, ``test/chat``
only). The policy is ``session_policy`` of ``tests/policy_builder.py``, which builds every
policy of the tests; ``metric`` (``tests/servers.py``) reads every gateway's and engine's metrics.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.service import parse_policy
from gateway.settings import Settings
from tests.fake_backend import FakeBackend
from tests.policy_builder import (
    BACKEND_TOKEN_ENV,
    CHAT_MODEL,
    KEY_ACME,
    KEY_GLOBEX,
    MAX_BODY_BYTES,
    OTHER_MODEL,
    session_policy,
)
from tests.servers import free_port, metric, serve_gateway_in_thread, serve_in_thread

__all__ = ["CHAT_MODEL", "KEY_ACME", "KEY_GLOBEX", "MAX_BODY_BYTES", "OTHER_MODEL", "metric"]  # what tests import here

BACKEND_TOKEN = "backend-secret-123"

StartGateway = Callable[..., AbstractContextManager[str]]


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


@contextmanager
def run_gateway(text: str, *, health_checks: bool = True, **settings: object) -> Iterator[str]:
    """Serve a gateway with policy ``text`` (written to a file it watches) on loopback; yield its
    API URL (``metric`` and ``tests.servers.admin_url`` find its operator listener from it).
    ``settings`` override ``Settings`` fields (connection guards, ...)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        snapshot = parse_policy(text, str(path))
        fields: dict[str, object] = {"port": 0, "admin_port": 0, **settings}
        config = Settings(policy_path=str(path), health_checks=health_checks, **fields)  # type: ignore[arg-type]
        with serve_gateway_in_thread(config, snapshot) as built:
            yield built.api_url


@pytest.fixture(scope="session", autouse=True)
def backend_credential() -> Iterator[str]:
    """The environment variable the test policy names as the backend's credential."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_TOKEN_ENV, BACKEND_TOKEN)
        yield BACKEND_TOKEN


@dataclass
class BackendServer:
    fake: FakeBackend
    url: str


@pytest.fixture(scope="session")
def backend_server() -> Iterator[BackendServer]:
    fake = FakeBackend()
    with serve_in_thread(fake) as url:
        yield BackendServer(fake, url)


@pytest.fixture
def backend(backend_server: BackendServer) -> Iterator[FakeBackend]:
    """The session's fake backend, with its default behaviour and an empty record."""
    fake = backend_server.fake
    defaults = FakeBackend()
    fake.tokens, fake.status, fake.error_body = defaults.tokens, defaults.status, defaults.error_body
    fake.cut_after, fake.gate = None, None
    fake.reset_hostile()
    fake.received.clear()
    yield fake
    gate, fake.gate = fake.gate, _OpenGate()
    if gate is not None:
        gate.set()  # a stream still blocked on it finishes at once instead of waiting for its timeout


class _OpenGate(threading.Event):
    """A gate that stays open: what a stream still running after its test waits on."""

    def __init__(self) -> None:
        super().__init__()
        self.set()

    def clear(self) -> None:
        pass


@pytest.fixture(scope="session")
def gateway_url(backend_server: BackendServer, backend_credential: str) -> Iterator[str]:
    with run_gateway(session_policy(backend_server.url)) as url:
        yield url


@pytest.fixture
def start_gateway(backend_credential: str) -> StartGateway:
    """``with start_gateway(session_policy(...), health_checks=False) as url:`` another gateway."""
    return run_gateway


@pytest.fixture(scope="session")
def http(gateway_url: str) -> Iterator[httpx.Client]:
    """Raw HTTP to the gateway, authenticated as acme, sending JSON (override ``headers`` per request)."""
    headers = {"authorization": f"Bearer {KEY_ACME}", "content-type": "application/json"}
    with httpx.Client(base_url=gateway_url, headers=headers, timeout=10) as client:
        yield client


@pytest.fixture(scope="session")
def client(gateway_url: str) -> Iterator[openai.OpenAI]:
    """The official SDK as tenant acme; no retries, so an error surfaces at once."""
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def globex_client(gateway_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEY_GLOBEX, max_retries=0, timeout=10) as sdk:
        yield sdk


@pytest.fixture
async def async_client(gateway_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as sdk:
        yield sdk


@pytest.fixture
def chat_body() -> dict[str, object]:
    """A valid chat request body (a fresh dict per test, to mutate freely)."""
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
